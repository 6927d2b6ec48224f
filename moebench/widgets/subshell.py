"""Keep the browser's widget messages on the kernel subshell JupyterLab sends them to.

JupyterLab 4.6 sends widget messages over a kernel subshell. ipykernel 7.4 routes a comm's next message
to wherever the kernel last wrote to that widget from; after a cell changed a widget (a button disabled
during a run, `toggle.set(...)`, `slider.value = ...`), that is the main shell. During an `await` cell the
main shell handles such a message without the busy/idle status the browser waits for: ipywidgets keeps
one message per widget in flight and holds every later change until that status comes, so the widget
stops reaching the kernel (a click during `await` lost, the next ones too). Our widgets' messages go
where the browser sent them instead; none of them is a reply a running cell waits for.
"""

from __future__ import annotations


def keep_on_subshell(widget) -> None:
    """Apply to `widget` and every widget inside it (children), once each."""
    for child in getattr(widget, "children", ()):
        keep_on_subshell(child)
    comm = getattr(widget, "comm", None)
    if comm is None or not hasattr(comm, "_reply_subshell_for") or getattr(comm, "_moebench_routed", False):
        return  # no kernel, or an ipykernel that routes no replies
    publish = comm.publish_msg

    def forget_route() -> None:
        with comm._reply_subshell_lock:
            comm.__dict__.pop("_reply_subshell_id", None)  # the next message goes where the browser sends it

    def publish_msg(*args, **kwargs):
        publish(*args, **kwargs)
        forget_route()

    comm.publish_msg = publish_msg
    comm._moebench_routed = True
    forget_route()  # the comm_open a cell sent pointed it at the main shell already
