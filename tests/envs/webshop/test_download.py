"""The WebShop data download command against a real HTTP mirror on loopback."""

from __future__ import annotations

import functools
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fedagent_flwr.envs.webshop.download import FILES, DownloadError, fetch, main

SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"
pytestmark = pytest.mark.skipif(not (SHARED / "webshop").exists(), reason=f"no WebShop data at {SHARED}")


def _local_copy(name: str) -> Path:
    return SHARED / ("hardness" if name.startswith("hardness/") else "webshop") / name.removeprefix("hardness/")


@pytest.fixture()
def mirror(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A mirror laid out like the upstream raw-file host, served by a real HTTP server."""
    root = tmp_path / "mirror"
    for item in FILES:
        target = root / item.source
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_local_copy(item.name), target)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_checks_hashes_and_only_refetches_what_is_missing_or_wrong(
    mirror: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = mirror
    data = tmp_path / "data"
    assert len(fetch(data, url)) == len(FILES)
    for item in FILES:
        assert (data / item.name).read_bytes() == _local_copy(item.name).read_bytes()
    assert fetch(data, url) == []  # all present with the right hashes
    (data / "items_ins_v2_1000.json").write_text("{}")  # damaged
    assert fetch(data, url) == [data / "items_ins_v2_1000.json"]
    assert not list(data.rglob(".*.part"))


def test_a_wrong_file_on_the_mirror_is_refused_and_not_kept(mirror: tuple[str, Path], tmp_path: Path) -> None:
    url, root = mirror
    pinned = next(item for item in FILES if item.sha256)
    (root / pinned.source).write_text("[]")
    with pytest.raises(DownloadError, match=f"{pinned.name} .* has sha256 .* expected {pinned.sha256}"):
        fetch(tmp_path / "data", url)
    assert not (tmp_path / "data" / pinned.name).exists()


def test_no_network_gives_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "data"), "--base-url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "download: error: cannot fetch http://127.0.0.1:9/" in err and "no network?" in err
