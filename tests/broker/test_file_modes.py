"""What the pair writes is readable by its owner only: files 0600, directories 0700.

A real pair runs, stores persistent messages, checkpoints its journal (small segments) and
replicates it; then every file and directory the nodes made is looked at with stat.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from reference_broker.pair import BrokerPair
from tests.broker.test_pair_stomp import send_persistent

pytestmark = [pytest.mark.broker]

SEGMENT = 8 * 1024


def modes(root: Path) -> dict[str, int]:
    return {
        str(path.relative_to(root)): stat.S_IMODE(path.stat().st_mode)
        for path in [root, *root.rglob("*")]
        if not path.is_symlink()
    }


@pytest.mark.timeout(120)
def test_journal_checkpoint_witness_and_secret_files_are_private(tmp_path: Path) -> None:
    root = tmp_path / "pair"
    with BrokerPair(root, segment_size=SEGMENT, checkpoint_segments=1) as pair:
        live = pair.live
        for round_ in range(6):
            assert len(send_persistent(live, f"/queue/modes-{round_}", 100)) == 100
        deadline = time.monotonic() + 30
        log = root / "live.log"
        while "checkpoint 1:" not in log.read_text():
            assert time.monotonic() < deadline, "no checkpoint was taken"
            time.sleep(0.1)
        pair.wait_synchronized(10)
        node_dirs = [root / "live", root / "backup", root / "pair"]
        found = {d.name: modes(d) for d in node_dirs}
    names = [name for tree in found.values() for name in tree]
    # What the check covers: the journals (segments hold the checkpoints), the lock, the
    # witness's claims and leases, the pair secret, the node's own records.
    for expected in ("journal", "status.json"):
        assert expected in found["live"] and expected in found["backup"], expected
    assert "node.json" in found["live"]  # the activation it served under
    assert any(n.startswith("journal/") and n.endswith(".seg") for n in found["live"]), names
    assert any(n.startswith("journal/") and n.endswith(".seg") for n in found["backup"]), names
    for expected in ("pair.secret", "witness.marker"):
        assert expected in found["pair"], expected
    assert any(n.startswith("activation-") for n in found["pair"])
    assert any(n.startswith("lease-") for n in found["pair"])
    wrong = {}
    for directory, tree in found.items():
        for name, mode in tree.items():
            path = tmp_path / "pair" / directory / name
            want = 0o700 if path.is_dir() else 0o600
            if mode != want:
                wrong[f"{directory}/{name}"] = oct(mode)
    assert not wrong, wrong
