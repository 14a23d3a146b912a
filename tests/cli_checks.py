"""The command line's refusals, checked as users see them: exit code 2, one line naming the command."""

from hf_dspark.cli.main import main


def refused(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"hf-dspark {argv[0]}: ")
    assert sum(text.startswith("hf-dspark ") for text in err.splitlines()) == 1  # one line says it all
    for needle in needles:
        assert needle in line, line
    return line
