"""Train the low-resolution drafter GPT for MuLo-SD: 8x8 tokens (16x16 images, r = 2), same
tokenizer and codebook as the target.

    python -m specdec.train drafter [--data DIR] [--steps N]
"""
from specdec.models.gpt import GPTConfig
from specdec.train.gpt_training import train_gpt

CONFIG = dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=8)


def main(argv=None) -> None:
    train_gpt("drafter", argv, image_size=16, config=GPTConfig(**CONFIG), steps=500, batch=64, lr=2e-3)


if __name__ == "__main__":
    main()
