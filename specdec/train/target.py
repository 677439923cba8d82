"""Train the target GPT: 16x16 tokens (32x32 images), class-conditional with a null class.

    python -m specdec.train target [--data DIR] [--steps N]
"""
from specdec.models.gpt import GPTConfig
from specdec.train.gpt_training import train_gpt

CONFIG = dict(dim=128, n_layer=3, n_head=4, multiple_of=32, grid_size=16)


def main(argv=None) -> None:
    train_gpt("target", argv, image_size=32, config=GPTConfig(**CONFIG), steps=600, batch=32, lr=2e-3)


if __name__ == "__main__":
    main()
