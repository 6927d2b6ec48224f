"""Other libraries' chatter kept out of the notebook.

mlx-lm prints its progress, transformers and huggingface_hub log warnings and draw progress bars, all into the
cell that happens to run (a notebook fills with their lines when a widget makes a variant). `captured()` collects
everything written to stdout or stderr while it is open, by print, by a logging handler that writes to either
stream (transformers keeps its own handler, made when it was imported) and by warnings, so the widget can show a
short status and keep the lines for whoever wants to read them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator


def stream_handlers(streams: list) -> list[logging.StreamHandler]:
    """Every logging handler, of any logger, that writes to one of `streams` (files are left alone)."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    found = {id(h): h for logger in loggers for h in logger.handlers
             if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in streams)}
    return list(found.values())


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    """Collect what is printed, logged to the console or warned inside the block; the list yielded holds its lines
    once the block ends (an error included)."""
    lines: list[str] = []
    buffer = io.StringIO()
    handlers = stream_handlers([sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__])
    before = [h.stream for h in handlers]
    with (contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer),
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always")
        for handler in handlers:
            handler.setStream(buffer)
        try:
            yield lines
        finally:
            for handler, stream in zip(handlers, before, strict=True):
                handler.setStream(stream)
            lines += [line for line in buffer.getvalue().splitlines() if line.strip()]
            lines += [f"{w.category.__name__}: {w.message}" for w in caught]
