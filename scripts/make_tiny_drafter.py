"""Write a random DFlash drafter (Kimi DFlash format) for a tiny target checkpoint.

python scripts/make_tiny_drafter.py OUT_DIR --target TARGET_DIR [--layers 1] [--block-size 8] [--seed 0]
"""

import argparse

from k26.tiny import check_out_dir, check_tiny_drafter, write_tiny_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--target", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:  # the target, OUT and the sizes as the loader will read them, before anything is written
        check_out_dir(a.out)
        check_tiny_drafter(a.target, layers=a.layers, block_size=a.block_size)
    except ValueError as e:  # (ConfigError too: it names the file or field)
        ap.error(f"--{e}" if str(e).startswith("target: ") else str(e))
    path = write_tiny_drafter(a.out, a.target, layers=a.layers, block_size=a.block_size, seed=a.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
