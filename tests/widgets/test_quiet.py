"""What other libraries print, log to the console or warn inside `captured()` lands in its list, not in the cell."""

import logging
import sys
import warnings

from moebench.widgets.quiet import captured


def test_prints_console_logs_and_warnings_are_collected_and_the_streams_restored(capsys):
    logger = logging.getLogger("moebench-test-chatter")
    handler = logging.StreamHandler(sys.stderr)  # as transformers makes its own, when imported
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with captured() as lines:
            print("[INFO] Loading")
            print("progress 10%", file=sys.stderr)
            logger.warning("a tokenizer warning")
            warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)
        out, err = capsys.readouterr()
        assert out == err == ""
        assert lines == ["[INFO] Loading", "progress 10%", "a tokenizer warning", "DeprecationWarning: a deprecation"]
        assert handler.stream is sys.stderr
        print("after")
        assert capsys.readouterr().out == "after\n"
    finally:
        logger.removeHandler(handler)


def test_the_lines_are_kept_when_the_block_raises():
    try:
        with captured() as lines:
            print("converting")
            raise RuntimeError("conversion failed")
    except RuntimeError:
        pass
    assert lines == ["converting"]
