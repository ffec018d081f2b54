"""Train a GPT: `python scripts/train.py --config=gpt_tiny [--train.steps=200 --mesh.tensor=2 ... --resume]`.

Flags -> config -> msjax.train.run. Every field of msjax/config.py is a dotted flag (`--help` lists them);
presets live in configs/.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msjax import cli  # noqa: E402


def main(argv: list[str]) -> int:
    def body() -> int:
        cfg, (common,) = cli.parse(argv, prog="train.py", description=__doc__)
        cli.setup_logging(common)
        import jax
        from tqdm.contrib.logging import logging_redirect_tqdm

        from msjax import distributed
        from msjax.train import run, summary_json

        distributed.initialize()
        with logging_redirect_tqdm():  # log records go around the progress bar, not through it
            out = summary_json(run(cfg))
        out.pop("sample", None)
        if jax.process_index() == 0:
            print(json.dumps(out))
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
