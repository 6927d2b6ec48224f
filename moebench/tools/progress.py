"""Progress on stderr for the commands that run longer than a few seconds, drawn to suit where stderr goes.

On a terminal a tqdm bar is redrawn in place as work is done. Elsewhere (a log file, CI, a notebook's captured
stderr) each redraw stays as a line of its own, so there the bar is drawn when it starts, at most once every
LOG_SECONDS after that, and when it ends, not at every update.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

LOG_SECONDS = 15.0  # the least time between two lines of progress when stderr is not a terminal


def live() -> bool:
    """Whether stderr is a terminal, where a bar redraws in place."""
    return sys.stderr.isatty()


class Progress(tqdm):
    """tqdm on stderr, redrawn in place on a terminal and every LOG_SECONDS at most elsewhere; a new postfix (what
    runs now) is drawn at once only on a terminal, elsewhere with the next line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("file", sys.stderr)
        if not live():
            kwargs.update(mininterval=LOG_SECONDS, maxinterval=LOG_SECONDS)
        super().__init__(*args, **kwargs)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        super().set_postfix(ordered_dict, refresh and live(), **kwargs)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        super().set_postfix_str(s, refresh and live())
