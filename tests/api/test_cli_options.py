"""The CLI's shared --quantization / --kv-cache-dtype options reach LLM(...) and load()
(no model is loaded: LLM and load are replaced by fakes that record their keywords)."""

import pytest

import jaxinfer
from jaxinfer import cli


class Stop(Exception):
    pass


@pytest.fixture
def calls(monkeypatch):
    recorded = []

    def fake(*args, **kwargs):
        recorded.append(kwargs)
        raise Stop

    monkeypatch.setattr(jaxinfer, "LLM", fake)
    monkeypatch.setattr(jaxinfer, "load", fake)
    return recorded


@pytest.mark.parametrize("argv", [["generate"], ["bench", "latency"], ["bench", "throughput"]])
def test_quantization_options_reach_llm(calls, argv):
    prompt = ["hi"] if argv == ["generate"] else []
    with pytest.raises(Stop):
        cli.main(argv + ["--quantization", "gguf", "--kv-cache-dtype", "int8"] + prompt)
    assert calls[-1]["quantization"] == "gguf" and calls[-1]["kv_cache_dtype"] == "int8"
    with pytest.raises(Stop):
        cli.main(argv + prompt)
    assert calls[-1]["quantization"] == "auto" and calls[-1]["kv_cache_dtype"] == "auto"
    with pytest.raises(Stop):
        cli.main(argv + ["--quantization", "none"] + prompt)
    assert calls[-1]["quantization"] is None


def test_ppl_keeps_its_options(calls, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    with pytest.raises(Stop):
        cli.main(["ppl", str(text), "--quantization", "int4"])
    assert calls[-1]["quantization"] == "int4"


@pytest.mark.parametrize("command, positional", [(["generate"], ["x"]), (["bench", "latency"], []),
                                                 (["bench", "throughput"], []), (["ppl"], ["f"])])
def test_every_command_takes_the_same_choices(command, positional, capsys):
    parser = cli.build_parser()
    for flag, good, bad in (("--quantization", "fp8", "int3"), ("--kv-cache-dtype", "fp8", "bf16")):
        args = parser.parse_args(command + [flag, good] + positional)
        assert vars(args)[flag[2:].replace("-", "_")] == good
        with pytest.raises(SystemExit):
            parser.parse_args(command + [flag, bad] + positional)
        assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["generate"], ["bench", "latency"], ["bench", "throughput"], ["bench", "serve"],
                                  ["serve"], ["convert"], ["ppl"]])
def test_help_prints_and_exits_cleanly(argv, capsys):
    """--help of every command: argparse formats each option's help with %
    (a bare "0.07%," in one of them made `jaxinfer generate --help` a traceback)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv + ["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out
