"""Stoker entry point: Hydra composes conf/train.yaml with your overrides, trainer.run trains.

    python train.py                                        # default job (digits, MLP)
    python train.py debug=default                          # one process, debug settings
    torchrun --standalone --nproc_per_node=4 train.py data.num_workers=8
"""
import signal
import sys

# importing torch takes seconds: a Ctrl-C then is no traceback either, and is kept even where
# torch's start-up swallows it (met inside its import of numpy, the run went on, exit 0)
_said = []
signal.signal(signal.SIGINT, lambda *a: (_said.append(1), signal.default_int_handler(*a)))
try:
    import hydra
    from omegaconf import DictConfig

    import trainer
    from trainer.cli import exit_on_error
except BaseException:  # (met inside an extension's import, a Ctrl-C may surface as another error)
    if not _said:
        raise
signal.signal(signal.SIGINT, signal.default_int_handler)
if _said:
    print("stoker: interrupted", file=sys.stderr)
    raise SystemExit(130) from None


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    trainer.run(cfg)


if __name__ == "__main__":
    exit_on_error(main)
