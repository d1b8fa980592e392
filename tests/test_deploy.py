"""``fedagent deploy`` refuses bad input with one line naming the culprit, exit status 2, and writes
nothing; the files themselves (certificates chain, keys load, connections merge) are checked by the
fast tests at the end of tests/e2e/test_deployment.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from fedagent_flwr.deploy import main, make_tls_files


@pytest.fixture(autouse=True)
def _flwr_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's own home, should anything read it, is a temporary folder, never ~/.flwr."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.mktemp("flwr-home-env")))


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, None for a folder, to show nothing was written."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _refused(argv: list[str], root: Path, capsys: pytest.CaptureFixture[str], *named: str) -> str:
    """Run ``deploy argv``: exit 2, one line on stderr naming each of ``named``, nothing written under ``root``."""
    before = _tree(root)
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith(f"deploy {argv[0]}: ") and not captured.out, err
    assert "Traceback" not in err and all(name in err for name in named), err
    assert _tree(root) == before, err
    return err


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder holding a regular file ``afile`` and a folder ``adir``; paths are relative to it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a file\n")
    (tmp_path / "adir").mkdir()
    return tmp_path


@pytest.mark.parametrize(("args", "named"), [
    (["afile/tls", "--host", "127.0.0.1"], ["afile", "not a folder"]),
    (["afile", "--host", "127.0.0.1"], ["afile", "not a folder"]),
    (["certs", "--host", "127.0.0.1", "--days", "-5"], ["--days -5", "1 to"]),
    (["certs", "--host", "127.0.0.1", "--days", "99999999"], ["--days 99999999", "1 to"]),
    (["certs", "--host", "127.0.0.1", "--days", "0"], ["--days 0", "1 to"]),
    (["certs", "--host", ""], ["--host is empty"]),
    (["certs", "--host", "127.0.0.1", "--host", "10.0.0.5:8000"], ["--host '10.0.0.5:8000'", "without a port"]),
    (["", "--host", "127.0.0.1"], ["DIRECTORY is empty"]),
], ids=["parent-is-a-file", "directory-is-a-file", "days-negative", "days-huge", "days-zero", "host-empty",
        "host-with-port", "directory-empty"])
def test_tls_refuses_bad_input_before_writing(site: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                              named: list[str]) -> None:
    _refused(["tls", *args], site, capsys, *named)


def test_tls_names_a_long_host_in_the_certificate(tmp_path: Path) -> None:
    """A DNS name longer than X.509's 64-character common name is still a valid subjectAltName."""
    from cryptography import x509

    host = "a" * 63 + "." + "b" * 40 + ".example.org"
    files = make_tls_files(tmp_path, hosts=(host,), days=1)
    san = x509.load_pem_x509_certificate(files.server_cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [host]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_node_key_refuses_an_empty_path_a_folder_or_a_file_as_its_folder(
        site: Path, capsys: pytest.CaptureFixture[str], force: bool) -> None:
    flag = ["--force"] if force else []
    _refused(["node-key", "", *flag], site, capsys, "PATH is empty")
    _refused(["node-key", ".", *flag], site, capsys, "'.'", "names no file")
    _refused(["node-key", "adir", *flag], site, capsys, "adir is a folder")
    (site / "keys").mkdir()
    (site / "keys" / "node.pub").mkdir()  # the public key's name is taken by a folder
    _refused(["node-key", "keys/node", *flag], site, capsys, "keys/node.pub is a folder")
    _refused(["node-key", "afile/node", *flag], site, capsys, "afile is not a folder")


def test_connection_refuses_a_flwr_home_or_config_that_is_not_what_it_should_be(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    insecure = ["x", "127.0.0.1:9093", "--insecure"]
    _refused(["connection", "afile", *insecure], site, capsys, "afile is not a folder", "FLWR_HOME")
    _refused(["connection", "afile/sub", *insecure], site, capsys, "afile is not a folder", "afile/sub")
    _refused(["connection", "", *insecure], site, capsys, "FLWR_HOME is empty")
    (site / "home" / "config.toml").mkdir(parents=True)
    _refused(["connection", "home", *insecure], site, capsys, "home/config.toml is a folder")
    (site / "binary").mkdir()
    (site / "binary" / "config.toml").write_bytes(b"\xff\xfe[superlink]\n")
    _refused(["connection", "binary", *insecure], site, capsys, "binary/config.toml is not UTF-8")


def test_connection_refuses_root_certificates_that_are_no_certificate(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tls = make_tls_files(site / "tls", hosts=("127.0.0.1",))
    (site / "empty.crt").write_bytes(b"")
    for certificates, named in [("missing.crt", "does not exist"), ("adir", "is a folder"),
                                ("empty.crt", "no PEM certificate"), ("tls/server.key", "no PEM certificate")]:
        _refused(["connection", "home", "r1", "127.0.0.1:9093", "--root-certificates", certificates],
                 site, capsys, f"--root-certificates {certificates}", named)
    # the CA that deploy tls wrote is taken
    assert main(["connection", "home", "r1", "127.0.0.1:9093", "--root-certificates", str(tls.ca_cert)]) == 0


def test_connection_refuses_an_address_that_is_not_host_and_port(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for address in ["not an address", "127.0.0.1:99999", "127.0.0.1:0", "", "127.0.0.1", "::1:9093",
                    "[not-v6]:9093", ":9093", "https://10.0.0.5:9093", "host name:9093", "10.0.0.5:９０"]:
        _refused(["connection", "home", "r1", address, "--insecure"], site, capsys, f"ADDRESS {address!r}",
                 "HOST:PORT")
    for address in ["10.0.0.5:9093", "[::1]:9093", "superlink.example.org:1", "node_1.lab:65535"]:
        assert main(["connection", "home", "r1", address, "--insecure", "--force"]) == 0, address


def test_a_file_that_cannot_be_written_is_one_line_naming_it(
        site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Permission denied (simulated: the tests may run as root) is the file and the reason, no traceback."""
    def denied(*args: object, dir: str, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied", dir)

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    err = _refused(["tls", "certs/site-a", "--host", "127.0.0.1"], site, capsys, "certs/site-a",
                   "Permission denied")
    assert "cannot use" in err  # and the folders it made for the files are gone again
    _refused(["node-key", "keys/node"], site, capsys, "keys", "Permission denied")
    _refused(["connection", "home", "x", "127.0.0.1:9093", "--insecure"], site, capsys, "home", "Permission denied")
