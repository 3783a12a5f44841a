"""The ``delayd`` command as a whole: its argument types, the environment defaults of
the client commands, the help of every subcommand, what each one imports, and the
place of delayd/cli/ on top of the layers."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from delayd.cli import args as cli_args
from delayd.cli.main import COMMANDS, build_parser, main
from tests.intake_support import ServeProcess
from tests.process_support import DELAYD, ROOT, child_env
from tests.test_layers import source_imports, unit_of

# --------------------------------------------------------------------- argument types


@pytest.mark.parametrize(
    ("convert", "text", "value"),
    [
        (cli_args.address, "127.0.0.1:20801", "127.0.0.1:20801"),
        (cli_args.address, "[::1]:20811", "[::1]:20811"),
        (cli_args.listen_address, "127.0.0.1:0", ("127.0.0.1", 0)),
        (cli_args.listen_address, "[::1]:0", ("::1", 0)),
        (cli_args.listen_address, "0.0.0.0:20801", ("0.0.0.0", 20801)),
        (cli_args.optional_listen_address, "off", None),
        (cli_args.optional_listen_address, "localhost:9", ("localhost", 9)),
        (cli_args.duration_ms, "1h30m", 5_400_000),
        (cli_args.utc_time_ms, "2026-11-22T10:00:00Z", 1_795_341_600_000),
        (cli_args.count, "10_000", 10_000),
        (cli_args.non_negative_count, "0", 0),
        (cli_args.seconds, "0.5", 0.5),
    ],
)
def test_types_read_the_right_forms(convert, text, value):
    assert convert(text) == value


@pytest.mark.parametrize(
    ("convert", "text", "says"),
    [
        (cli_args.address, "nohost", "has no port; write HOST:PORT"),
        (cli_args.address, "h:0", "the port must be 1 to 65535"),
        (cli_args.address, "::1:20811", "put an IPv6 address in brackets"),
        (cli_args.listen_address, "h:70000", "port must be"),
        (cli_args.duration_ms, "90", "use a number and a unit"),
        (cli_args.utc_time_ms, "2026-11-22T10:00:00", "no time zone"),
        (cli_args.count, "0", "not positive"),
        (cli_args.count, "x", "not a whole number"),
        (cli_args.count, "\uff15", "not a whole number"),  # a full-width 5
        (cli_args.non_negative_count, "-1", "negative"),
        (cli_args.seconds, "0", "above 0"),
        (cli_args.seconds, "nan", "above 0"),
        (cli_args.seconds, "soon", "not a number of seconds"),
    ],
)
def test_types_refuse_with_a_reason(convert, text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        convert(text)


def test_a_bad_value_exits_2_naming_the_flag_and_the_reason(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["send", "--server", "h:1", "--subject", "s", "--delay", "1y", "x"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --delay: '1y' is not a duration" in err
    assert "for example" in err


# ------------------------------------------------------------------------ environment


def parsed(monkeypatch, environ: dict[str, str], *words: str) -> argparse.Namespace:
    for name in (cli_args.SERVER_VARIABLE, cli_args.BROKER_VARIABLE, cli_args.TOKEN_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return build_parser(words[0]).parse_args(list(words))


SEND = ("send", "--subject", "s", "--delay", "1s", "body")


def test_the_server_and_token_come_from_the_environment(monkeypatch):
    environ = {"DELAYD_SERVER": "db.internal:20801", "DELAYD_TOKEN": "s3cret"}
    args = parsed(monkeypatch, environ, *SEND)
    assert (args.server, args.token) == ("db.internal:20801", "s3cret")
    args = parsed(monkeypatch, environ, "cancel", "order-17")
    assert (args.server, args.token) == ("db.internal:20801", "s3cret")
    args = parsed(monkeypatch, environ, "reschedule", "--delay", "5m", "order-17")
    assert (args.server, args.token, args.delay) == ("db.internal:20801", "s3cret", 300_000)
    environ = {"DELAYD_BROKER": "[::1]:20811", "DELAYD_TOKEN": "s3cret"}
    args = parsed(monkeypatch, environ, "consume", "--subject", "s", "--group", "g")
    assert (args.broker, args.token) == ("[::1]:20811", "s3cret")
    # The broker, a server, takes the secret it requires from there too.
    assert parsed(monkeypatch, environ, "broker", "--data", "d").token == "s3cret"


def test_a_flag_wins_over_its_variable(monkeypatch):
    environ = {"DELAYD_SERVER": "db.internal:20801", "DELAYD_TOKEN": "s3cret"}
    args = parsed(monkeypatch, environ, *SEND[:1], "--server", "h:2", "--token", "t", *SEND[1:])
    assert (args.server, args.token) == ("h:2", "t")


def test_without_flag_or_variable_the_server_is_required(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        parsed(monkeypatch, {}, *SEND)
    assert exited.value.code == 2
    assert "required: --server" in capsys.readouterr().err
    assert parsed(monkeypatch, {"DELAYD_SERVER": "h:1"}, *SEND).token is None


def test_a_bad_variable_is_named_in_the_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        parsed(monkeypatch, {"DELAYD_SERVER": "nohost"}, *SEND)
    assert exited.value.code == 2
    assert "argument --server: DELAYD_SERVER: address 'nohost' has no port" in (
        capsys.readouterr().err
    )
    # A good flag never reads the bad variable.
    assert parsed(monkeypatch, {"DELAYD_SERVER": "nohost"}, *SEND, "--server", "h:1").server


def test_help_names_the_variables_and_never_prints_the_token(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parsed(monkeypatch, {"DELAYD_TOKEN": "s3cret-value"}, "send", "--help")
    out = capsys.readouterr().out
    assert "$DELAYD_SERVER" in out and "$DELAYD_TOKEN" in out and "the flag wins" in out
    assert "s3cret-value" not in out


@pytest.mark.slow
def test_client_commands_reach_a_real_server_through_the_environment(tmp_path, procs):
    token = "s3cret"
    server = procs.start(ServeProcess(tmp_path / "data", env={"DELAYD_SERVER_TOKEN": token}))
    intake = "{}:{}".format(*server.address)
    broker = "{}:{}".format(*server.broker_address)

    def delayd(*words: str, **environ: str) -> subprocess.CompletedProcess[str]:
        env = {**child_env(), **environ}
        for name in ("DELAYD_SERVER", "DELAYD_BROKER", "DELAYD_TOKEN"):
            if name not in environ:
                env.pop(name, None)
        return subprocess.run(
            [*DELAYD, *words], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
        )

    send_m1 = ("send", "--subject", "s", "--delay", "1h", "--id", "m1", "hello")
    sent = delayd(*send_m1, DELAYD_SERVER=intake, DELAYD_TOKEN=token)
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout)["message_id"] == "m1"
    # The wrong token in the environment is refused; the right one as a flag wins.
    refused = delayd(*SEND, DELAYD_SERVER=intake, DELAYD_TOKEN="wrong")
    assert refused.returncode == 1 and "token" in refused.stderr.lower(), refused.stderr
    flagged = delayd(*SEND, "--token", token, DELAYD_SERVER=intake, DELAYD_TOKEN="wrong")
    assert flagged.returncode == 0, flagged.stderr
    cancelled = delayd("cancel", "m1", DELAYD_SERVER=intake, DELAYD_TOKEN=token)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["outcome"] == "CANCELLED"
    consumed = delayd(
        "consume", "--subject", "s", "--group", "g", "--timeout", "0.5",
        DELAYD_BROKER=broker, DELAYD_TOKEN=token,
    )  # fmt: skip
    assert consumed.returncode == 0, consumed.stderr
    refused = delayd(
        "consume", "--subject", "s", "--group", "g", "--timeout", "0.5",
        DELAYD_BROKER=broker, DELAYD_TOKEN="wrong",
    )  # fmt: skip
    assert refused.returncode == 1, refused.stderr


# ------------------------------------------------------------------------------- help

# What reST leaves in text meant for a terminal: ``literal``, :role:`target`, `x`_.
RST_MARKUP = re.compile(r"``|:[a-z]+:`|`_\b")


def help_text(capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*words, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def every_help(capsys) -> dict[str, str]:
    texts = {"delayd": help_text(capsys)}
    for name in COMMANDS:
        texts[name] = help_text(capsys, name)
    for what in ("summary", "message-log", "bucket", "dispatch", "checkpoints", "find"):
        texts[f"inspect {what}"] = help_text(capsys, "inspect", what)
    return texts


def test_no_help_shows_rest_markup(capsys):
    texts = every_help(capsys)
    assert len(texts) == 1 + len(COMMANDS) + 6
    marked = {name: RST_MARKUP.findall(text) for name, text in texts.items()}
    assert {name: found for name, found in marked.items() if found} == {}
    for name in COMMANDS:  # each has its own description, not just the summary line
        assert len(texts[name].split("\n\n")) > 3, texts[name]


def test_markup_is_what_the_check_finds():
    assert RST_MARKUP.findall("run ``delayd serve``; see :func:`run` and `docs`_") == [
        "``",
        "``",
        ":func:`",
        "`_",
    ]


def test_no_command_prints_the_list_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


# ---------------------------------------------------------------------------- imports


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    script = (
        f"import sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\nprint(sorted(sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True,
        timeout=30, check=True,
    )  # fmt: skip
    return set(json.loads(done.stdout.splitlines()[-1].replace("'", '"')))


OPERATOR_TOOLS = {"delayd.top", "delayd.inspect", "delayd.audit", "delayd.bench", "rich"}


def test_version_and_help_import_no_command():
    for words in (["--version"], ["--help"]):
        loaded = modules_after(f"from delayd.cli.main import main; main({words!r})")
        assert {m for m in loaded if m.startswith("delayd.cli.")} == {"delayd.cli.main"}
        assert "trio" not in loaded


def test_serve_does_not_import_the_operator_tools():
    loaded = modules_after("from delayd.cli.main import main; main(['serve', '--help'])")
    assert "delayd.cli.serve" in loaded and "delayd.server.app" in loaded
    assert loaded.isdisjoint(OPERATOR_TOOLS)
    assert not {m for m in loaded if m.startswith("pyspark")}


# ----------------------------------------------------------------------------- layers


def library_imports() -> dict[str, set[str]]:
    """What each module of delayd and storage outside delayd.cli imports."""
    found = source_imports("delayd", "storage")
    return {module: names for module, names in found.items() if unit_of(module) != "delayd.cli"}


def test_only_the_entry_point_imports_the_cli():
    importers = {
        module
        for module, names in library_imports().items()
        if any(unit_of(name) == "delayd.cli" for name in names)
    }
    assert importers == {"delayd.__main__"}


def test_the_library_parses_no_command_line():
    library = library_imports()
    # delayd.cluster's __main__ is a demo of the election, run as python -m delayd.cluster.
    users = {module for module, names in library.items() if "argparse" in names}
    assert users == {"delayd.cluster.__main__"}
    assert len(library) > 100  # the walk saw the packages


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_module_has_arguments_and_a_run(name):
    module = __import__(COMMANDS[name][0], fromlist=["run"])
    assert callable(module.add_arguments) and callable(module.run)
    assert module.__doc__ and os.path.dirname(module.__file__).endswith(
        os.path.join("delayd", "cli")
    )
