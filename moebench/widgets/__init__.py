"""Notebook widgets: each reads step records (moebench.inspect.record) or their analyses, never model internals;
those that start decodes run them on the notebook's thread (mainthread.Owner).

    picker = ModelPicker(); controls = PromptControls(picker, "def add(a, b):", tokens=12)
    stepper = TokenStepper(controls.trace, on_step=router.show)   # play / previous / next / slider
    RouterView, ExpertView, DiffView, CompareSteps, ExpertLoadMap   # plotly views (static copies for saved notebooks)
    MedianTable, StaleNote, on_all_decoded                          # views that follow the model picker
    MixingView                                                      # a hybrid's linear / full layers, gates, states
    FusedToggle, TokensPerSecondChart, LiveDecode, DecodeBenchmark  # the switch, live tok/s, the benchmark
    InterventionPanel, ExportBar                                    # interventions as controls; export buttons
    DriftControls, DriftView                                        # routing drift of a model's variants
"""

from .bench import DecodeBenchmark
from .controls import ModelPicker, PromptControls, on_all_decoded
from .diff import CompareSteps, DiffView, MedianTable
from .drift import DriftControls, DriftView
from .experts import ExpertView
from .exportbar import ExportBar
from .intervene import InterventionPanel
from .live import LiveDecode
from .loadmap import ExpertLoadMap
from .mixing import MixingView
from .router import RouterView
from .stale import StaleNote
from .stepper import TokenStepper, TokenStrip
from .toggle import FusedToggle
from .tps import TokensPerSecondChart

__all__ = ["CompareSteps", "DecodeBenchmark", "DiffView", "DriftControls", "DriftView", "ExpertLoadMap", "ExpertView",
           "ExportBar", "FusedToggle", "InterventionPanel", "LiveDecode", "MedianTable", "MixingView", "ModelPicker",
           "PromptControls", "RouterView", "StaleNote", "TokenStepper", "TokenStrip", "TokensPerSecondChart",
           "on_all_decoded"]
