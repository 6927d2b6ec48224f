"""Notebook widgets: each reads step records (moebench.inspect.record) or their analyses, never model internals.

    stepper = TokenStepper(trace, on_step=router.show)   # play / previous / next / slider
    RouterView, ExpertView, DiffView, ExpertLoadMap       # plotly FigureWidget views
    FusedToggle, TokensPerSecondChart, LiveDecode         # the switch, the tok/s chart, live decoding
"""

from .diff import DiffView
from .experts import ExpertView
from .live import LiveDecode
from .loadmap import ExpertLoadMap
from .router import RouterView
from .stepper import TokenStepper, TokenStrip
from .toggle import FusedToggle
from .tps import TokensPerSecondChart

__all__ = ["DiffView", "ExpertLoadMap", "ExpertView", "FusedToggle", "LiveDecode", "RouterView", "TokenStepper",
           "TokenStrip", "TokensPerSecondChart"]
