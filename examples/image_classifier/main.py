"""Trains a small CNN image classifier with mixed precision (linen + jaxamp).

  python examples/image_classifier/main.py --workdir /tmp/cls --precision bf16-mixed
  python examples/image_classifier/main.py --workdir /tmp/cls --precision fp16-mixed \
      --dataset fashion_mnist --data_dir ~/data/fashion-mnist

Writes metrics.json and loss.png into --workdir.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a clean clone

from examples import utils  # noqa: E402
from examples.image_classifier import config as config_lib  # noqa: E402
from examples.image_classifier import train  # noqa: E402


def main(argv=None):
    parser = utils.add_common_flags(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--dataset", choices=["synthetic", "fashion_mnist", "cifar10"])
    parser.add_argument("--data_dir")
    parser.add_argument("--eval_every", type=int)
    parser.add_argument("--image_size", type=int, help="side of the synthetic images")
    parser.add_argument(
        "--widths",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        help="conv channels per stage, e.g. 32,64",
    )
    args = parser.parse_args(argv)
    config = utils.apply_flags(config_lib.get_config(), args)
    metrics = train.train_and_evaluate(config, args.workdir)
    summary = metrics["summary"]
    print(
        f"precision={metrics['policy']} final_loss={summary['final_loss']:.4f} "
        f"eval_accuracy={summary['eval_accuracy']:.4f} skipped_steps={summary['skipped_steps']} "
        f"-> {args.workdir}/metrics.json, loss.png"
    )


if __name__ == "__main__":
    main()
