"""Prefix-affine routing on Ray Serve: requests sharing a prompt prefix go to the replica that served it.

Each replica has its own prefix cache (--enable-prefix-caching), so a shared system prompt or a
conversation's history is only computed once per replica that sees it. Spreading such requests at random
over N replicas computes it N times and keeps N copies; sending them to one replica keeps the hits.

What the router can see: Ray Serve's request router (`choose_replicas`) sees the arguments of the handle
call it routes. A request arriving through Serve's HTTP proxy is handed to the first deployment as its
ASGI scope only (path, headers); the body is read afterwards, from the replica it was routed to. So the
router in front of the first deployment cannot see a prompt. The application therefore starts with a
thin ingress deployment (server/ray/ingress.py) that reads the body, computes `prefix_hashes` here, and
calls the KVServe deployment through a DeploymentHandle with them as the `prefix_hashes` keyword
argument; PrefixAffineRouter, KVServe's request router, reads that argument.

The policy: the prompt's start is cut into PREFIX_CHUNK_CHARS-character chunks and each cumulative
prefix hashed. The router remembers which replica each hash was last sent to (bounded, least recently
used first out) and sends a request to the replica owning its longest known prefix. When no prefix is
known, or that replica is overloaded, it falls back to the less loaded of two random replicas (Serve's
power of two choices), and that choice becomes the prefix's owner if it had none. Overloaded: at least
`overload_threshold` requests ongoing (its running batch is full, so the request would queue behind it),
or more than twice the ongoing requests of the least-loaded other replica, plus one (skipping a prefill
is not worth leaving a replica idle while another runs a batch two or more times its size). A replica at
max_ongoing_requests is never chosen: Serve skips it and tries the next rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)

PREFIX_CHUNK_CHARS = 128  # about two KV-cache blocks of 16 tokens: a shorter match saves little
MAX_PREFIX_CHUNKS = 64  # hash at most the first 8 KiB characters of a prompt
PREFIX_HASHES_KWARG = "prefix_hashes"
GENERATION_PATHS = ("/completions", "/chat/completions", "/responses")


def prompt_start(path: str, request: dict[str, Any]) -> str:
    """The start of the prompt a generation request asks for, as text in a stable form ("" if none).

    Chat messages and Responses input items are flattened role by role, so two requests share a start
    exactly when their conversations do; token-id prompts become their ids. Only the first prompt of a
    multi-prompt completions request counts.
    """
    limit = PREFIX_CHUNK_CHARS * MAX_PREFIX_CHUNKS
    if path.endswith("/responses"):
        parts = [_text(request.get("instructions"))]
        items = request.get("input")
        parts += [_message_text(item) for item in items] if isinstance(items, list) else [_text(items)]
    elif isinstance(request.get("messages"), list):
        parts = [_message_text(message) for message in request["messages"]]
    else:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # the first of several prompts
        parts = [_text(prompt)]
    text = ""
    for part in parts:
        text += part
        if len(text) >= limit:
            break
    return text[:limit]


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return _text(message)
    return f"{message.get('role', '')}\x1f{_text(message.get('content'))}\x1e"


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts, or token ids
        return "".join(_text(part.get("text")) if isinstance(part, dict) else f"{part}," for part in value)
    return str(value)


def prefix_hashes(path: str, body: bytes) -> list[int]:
    """Hashes of the cumulative PREFIX_CHUNK_CHARS-character prefixes of a generation request's prompt start,
    shortest first, the last one of all of it; [] for a request that is not generation or whose body is not
    a JSON object."""
    if not path.endswith(GENERATION_PATHS):
        return []
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # the replica answers the 400 (server/http/json_body.py)
        return []
    if not isinstance(request, dict):
        return []
    text = prompt_start(path, request).encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(digest_size=8)
    hashes = []
    for start in range(0, len(text), PREFIX_CHUNK_CHARS):  # the last chunk may be short: the whole prompt
        digest.update(text[start : start + PREFIX_CHUNK_CHARS])
        hashes.append(int.from_bytes(digest.copy().digest(), "little"))
    return hashes


class PrefixAffineRouter(RequestRouter):
    """KVServe's request router with --replica-routing prefix (see the module docstring)."""

    def initialize_state(self, overload_threshold: int = 64, max_tracked_prefixes: int = 100_000) -> None:
        """overload_threshold: ongoing requests at which the affine replica is passed over (the engine's
        --max-num-seqs). max_tracked_prefixes: prefix hashes remembered, least recently used dropped first."""
        self._overload_threshold = overload_threshold
        self._max_tracked = max_tracked_prefixes
        self._owners: OrderedDict[int, ReplicaID] = OrderedDict()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks: [the affine replica], then two random others; or two random replicas when no prefix is
        known or the affine replica is overloaded (Serve takes the less loaded of a rank's replicas)."""
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every call offers every replica (the last rank), so Serve may back off between tries.
            pending_request.routing_context.should_backoff = True
        affine = self.affine_replica(candidate_replicas, _hashes_of(pending_request))
        if affine is None:
            return [_two_choices(candidate_replicas)]
        others = [replica for replica in candidate_replicas if replica.replica_id != affine.replica_id]
        if self._is_overloaded(affine, others):
            return [_two_choices(candidate_replicas)]
        return [[affine], _two_choices(others)] if others else [[affine]]

    def affine_replica(self, candidates: list[RunningReplica], hashes: list[int]) -> RunningReplica | None:
        """The candidate owning the longest known prefix among `hashes` (None: no prefix known)."""
        by_id = {replica.replica_id: replica for replica in candidates}
        for prefix_hash in reversed(hashes):
            owner = self._owners.get(prefix_hash)
            if owner in by_id:
                self._owners.move_to_end(prefix_hash)
                return by_id[owner]
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """The request's prefixes now live in `replica_id`'s cache: those no live replica owns become its.
        A prefix that a live replica owns keeps its owner: an overflow to another replica must not move a
        shared system prompt's traffic away from the replica that holds it."""
        for prefix_hash in _hashes_of(pending_request):
            owner = self._owners.get(prefix_hash)
            if owner is None or owner not in self.curr_replicas:
                self._owners[prefix_hash] = replica_id
            self._owners.move_to_end(prefix_hash)
        while len(self._owners) > self._max_tracked:
            self._owners.popitem(last=False)

    def _is_overloaded(self, replica: RunningReplica, others: list[RunningReplica]) -> bool:
        ongoing = self._ongoing(replica)
        least = min((self._ongoing(other) for other in others), default=ongoing)
        return ongoing >= self._overload_threshold or ongoing > 2 * least + 1

    def _ongoing(self, replica: RunningReplica) -> int:
        # The cache holds what the last probe, send or completion said; an entry no request has refreshed
        # for a while has expired, and a replica nobody sent to lately is taken as idle.
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return queue_len if queue_len is not None else 0


def _hashes_of(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    hashes = pending_request.kwargs.get(PREFIX_HASHES_KWARG)
    return hashes if isinstance(hashes, list) else []


def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
