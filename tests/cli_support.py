"""What the CLI tests share: the embedded pair's directories and `run` (main() with its output captured); the
`no_loading` fixture is in conftest.py."""

from k26.__main__ import main
from k26.embedded import default_drafter_dir, default_model_dir

TARGET, DRAFTER = str(default_model_dir()), str(default_drafter_dir())


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err
