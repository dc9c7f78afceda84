"""Stoker entry point: Hydra composes conf/train.yaml with your overrides, trainer.run trains.

    python train.py                                        # default job (digits, MLP)
    python train.py debug=default                          # one process, debug settings
    torchrun --standalone --nproc_per_node=4 train.py data.num_workers=8
"""
import os
import signal

# importing torch takes seconds, and a Ctrl-C then must not raise: torch's start-up swallowed a
# KeyboardInterrupt met inside its import of numpy (the run went on, exit 0), surfaced one met
# inside an extension's import as an ImportError, and aborted (SIGABRT) on one raised inside a
# call from its C++ code. Until the imports are done a Ctrl-C ends the process where it lands:
# nothing is written yet, so nothing is lost.
signal.signal(signal.SIGINT, lambda *a: (os.write(2, b"stoker: interrupted\n"), os._exit(130)))
# A preemption signal (a scheduler's SIGTERM, SIGUSR1 or SIGHUP) until the run's own handler
# takes over ends it as a preemption before the first step: exit 75 and its line (a rank
# ended at -15 without a word before; trainer/startsignals.py).
from trainer import startsignals  # noqa: E402 (the standard library only)

if __name__ == "__main__":  # (not in a spawned loader worker, which imports this as __mp_main__)
    startsignals.hold()
import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import trainer  # noqa: E402
from trainer.cli import exit_on_error  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    trainer.run(cfg)


if __name__ == "__main__":
    exit_on_error(main)
