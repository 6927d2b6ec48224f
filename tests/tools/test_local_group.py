import json
import socket
import sys

import pytest

from moebench.errors import MoebenchError
from moebench.tools.local_group import free_ports, run_local_group

RANK_WRITES = ("import os, sys; hosts = open(os.environ['MLX_HOSTFILE']).read(); "
               "open(os.path.join(sys.argv[1], os.environ['MLX_RANK']), 'w').write(hosts)")


def test_every_rank_gets_its_rank_and_one_hostfile_of_a_port_each(tmp_path):
    assert run_local_group([sys.executable, "-c", RANK_WRITES, str(tmp_path)], 3, {}) == 0
    hostfiles = [json.loads((tmp_path / str(r)).read_text()) for r in range(3)]
    assert hostfiles[0] == hostfiles[1] == hostfiles[2]
    ports = [int(entry[0].split(":")[1]) for entry in hostfiles[0]]
    assert [entry[0].split(":")[0] for entry in hostfiles[0]] == ["127.0.0.1"] * 3
    assert ports == list(range(ports[0], ports[0] + 3))


def test_a_failing_rank_stops_the_others_and_is_named(tmp_path):
    script = "import os, sys, time; r = os.environ['MLX_RANK']; sys.exit(3) if r == '1' else time.sleep(60)"
    with pytest.raises(MoebenchError, match="rank 1 of 2 exited with code 3"):
        run_local_group([sys.executable, "-c", script], 2, {})


def test_free_ports_are_consecutive_and_bindable():
    ports = free_ports(2)
    assert ports[1] == ports[0] + 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_group_needs_two_processes():
    with pytest.raises(MoebenchError, match="at least 2"):
        run_local_group([sys.executable, "-c", "pass"], 1, {})
