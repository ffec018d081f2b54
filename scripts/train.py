"""Train a GPT: `python scripts/train.py --config=gpt_tiny [--train.steps=200 --mesh.tensor=2 ... --resume]`.

Flags -> config -> msjax.train.run. Every field of msjax/config.py is a dotted flag (`--help` lists them);
presets live in msjax/configs/.
"""

import json
import os
import sys
import traceback

from msjax import cli


def main(argv: list[str]) -> int:
    # `--profile_steps=K:N` (or `--profile_steps K:N`) is short for `--observe.profile_steps=K:N` (trace steps
    # K..K+N-1).
    argv = ["--observe." + a[2:] if a.split("=")[0] == "--profile_steps" else a for a in argv]

    def body() -> int:
        cfg, (common,) = cli.parse(argv, prog="train.py", description=__doc__)
        cli.setup_logging(common)
        import jax
        from tqdm.contrib.logging import logging_redirect_tqdm

        from msjax import distributed
        from msjax.checkpoint import CheckpointError
        from msjax.control import ControlError
        from msjax.control.worker import worker_hooks
        from msjax.faults import NonFiniteLossError
        from msjax.parallel import xla_flags
        from msjax.supervise import phases
        from msjax.supervise.heartbeat import supervisor_hooks
        from msjax.train import run, summary_json

        phases.mark("imports")

        xla_flags.apply(cfg.mesh.tp_overlap)  # before the backend starts: XLA reads XLA_FLAGS once
        try:
            distributed.initialize()
            phases.mark("distributed")
            with logging_redirect_tqdm():  # log records go around the progress bar, not through it
                out = summary_json(run(cfg, hooks=worker_hooks() + supervisor_hooks(cfg)))
        except ControlError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (CheckpointError, NonFiniteLossError) as e:  # the run stopped; the newest verified checkpoint is kept
            # run() has ended the threads of Orbax's failed save (msjax.checkpoint.manager._release_abandoned_save),
            # so the interpreter exits normally.
            print(f"error: {e}", file=sys.stderr)
            return 1
        except BaseException:
            if jax.process_count() > 1:
                # jax.distributed's exit handler waits at a shutdown barrier for every process while the others
                # wait in a collective for this one: end now, so the launcher or supervisor sees the failure.
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            raise
        out.pop("sample", None)
        if jax.process_index() == 0:
            print(json.dumps(out))
        return 0

    return cli.main_guard(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
