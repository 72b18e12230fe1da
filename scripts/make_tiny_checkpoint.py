"""Write a random Kimi-format checkpoint directory (see k26/tiny.py for the exact layout).

python scripts/make_tiny_checkpoint.py OUT_DIR [--flavour k25|k2-thinking] [--quant int4|none]
    [--shards 3] [--seed 0] [--hidden-size 128 --num-hidden-layers 3 ...]
"""

import argparse

from k26.tiny import DEFAULT_SIZES, check_out_dir, check_tiny, write_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--flavour", default="k25", choices=["k25", "k2-thinking"])
    ap.add_argument("--quant", default="int4", choices=["int4", "none"])
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    for k, v in DEFAULT_SIZES.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    a = vars(ap.parse_args())
    sizes = {k: a[k] for k in DEFAULT_SIZES}
    kw = {"flavour": a["flavour"], "quant": a["quant"], "shards": a["shards"], **sizes}
    try:
        check_out_dir(a["out"])
        check_tiny(**kw)
    except ValueError as e:  # (ConfigError too) OUT, a size or the shards, named, before any write
        ap.error(str(e))
    path = write_tiny_checkpoint(a["out"], seed=a["seed"], **kw)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
