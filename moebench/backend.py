"""MLX, the array library moebench runs on, comes from one of moebench's extras: `moebench[cpu]` on Linux (MLX's CPU
build: plain `mlx` installs there but does not import), `moebench[apple]` on macOS (Metal), `moebench[cuda]` with an
NVIDIA GPU. moebench's __init__ calls require_mlx before it imports anything that needs MLX, so a plain
`pip install moebench` is told which extra it lacks instead of meeting a ModuleNotFoundError deep in an import.
"""

from __future__ import annotations

import platform
import sys

from .errors import MoebenchError


class BackendUnavailable(MoebenchError, ImportError):
    """MLX is not installed, or does not import here; the message names the extra that installs it."""


def install_hint(system: str) -> str:
    """Which of moebench's extras installs a working MLX on `system` (platform.system()'s name)."""
    if system == "Darwin":
        return "pip install 'moebench[apple]' (MLX with Metal)"
    if system == "Linux":
        return "pip install 'moebench[cpu]' (MLX's CPU build), or 'moebench[cuda]' with an NVIDIA GPU"
    return f"MLX runs on macOS and Linux, and this is {system or 'an unknown system'}"


def require_mlx() -> None:
    """A BackendUnavailable naming the extra to install when `import mlx.core` fails."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == "mlx"
        state = "is not installed" if missing else "is installed but does not import"
        error = BackendUnavailable(f"moebench needs MLX, which {state} in this Python ({sys.executable}: {e}); "
                                   f"install it with moebench's extra: {install_hint(platform.system())}")
        _report_if_uncaught()
        raise error from None


def _report_if_uncaught() -> None:
    """Where nothing catches the error (the `moebench` command, whose first import is where it is raised), print it
    as the command prints every error, one line and no traceback; anything else as before."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if isinstance(value, BackendUnavailable):
            print(f"moebench: error: {value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook
