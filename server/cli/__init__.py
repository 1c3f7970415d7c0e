"""`kvserve serve`: its flags (flags.py: FLAGS, each also read from KVSERVE_<NAME>; kinds.py: how a flag's
text becomes its value), the configs built from them (args.py) and the uvicorn run with its stop on
SIGTERM/SIGINT (runner.py).

server/__main__.py calls add_arguments(parser) and run(args); `python -m server.cli` works too (__main__.py).
"""

from server.cli.args import add_arguments, config_from_args, scale_out_from_args
from server.cli.flags import FLAGS, env_name
from server.cli.runner import main, run

__all__ = ["FLAGS", "add_arguments", "config_from_args", "env_name", "main", "run", "scale_out_from_args"]
