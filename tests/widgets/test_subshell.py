from threading import Lock
from types import SimpleNamespace

from ipykernel.comm.comm import BaseComm

from moebench.widgets.subshell import keep_on_subshell


class CellComm(BaseComm):
    """ipykernel's comm routing, with publish_msg as a cell's write to the widget leaves it (main shell)."""

    def __init__(self):
        self._reply_subshell_lock, self._reply_subshell_ids = Lock(), {}

    def publish_msg(self, *args, **kwargs):
        self._reply_subshell_id = None


def test_after_a_cell_writes_to_a_widget_its_messages_still_go_to_the_browsers_subshell():
    plain, kept, opened = CellComm(), CellComm(), CellComm()
    opened.publish_msg("comm_open", {})  # made in a cell: its comm_open points it at the main shell
    keep_on_subshell(SimpleNamespace(comm=opened))
    assert opened._reply_subshell_for({}, "subshell-1") == "subshell-1"
    inner = SimpleNamespace(comm=kept)
    keep_on_subshell(SimpleNamespace(comm=None, children=(inner,)))
    for comm in (plain, kept):
        comm.publish_msg("comm_msg", {"method": "update"})
    assert plain._reply_subshell_for({"method": "update"}, "subshell-1") is None  # ipykernel: the main shell
    assert kept._reply_subshell_for({"method": "update"}, "subshell-1") == "subshell-1"
    keep_on_subshell(inner)  # once per widget
    kept.publish_msg("comm_msg", {})
    assert kept._reply_subshell_for({}, "subshell-2") == "subshell-2"
