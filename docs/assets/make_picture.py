"""Build docs/assets/demo.png, the README's picture, from what `make demo` writes to out/.

    make demo && .venv/bin/python docs/assets/make_picture.py [OUT_DIR]

Left: the first row (one image per class, seed 0) of the ar, mulo and ssd grids; right: the first
images of MuLo-SD's maps (image, acceptance map: white = up-sampled draft kept, islands of
resampled tokens: one colour each). Kept small: it is committed.
"""
import os
import sys

from PIL import Image, ImageDraw, ImageFont

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "out")
METHODS = ("ar", "mulo", "ssd")
MAP_ROWS = 3        # images of the MuLo-SD maps shown
TILE = 64           # side of one image in the grids (32 px at scale 2)
PAD = 2             # grid padding of specdec.images.grid
LABEL_W = 56
HEAD = 22           # room for the titles above the panels


def first_row(path):
    img = Image.open(path).convert("RGB")
    return img.crop((0, 0, img.width, TILE + 2 * PAD))


def main():
    rows = [first_row(os.path.join(OUT, f"{m}.png")) for m in METHODS]
    maps = Image.open(os.path.join(OUT, "mulo_maps.png")).convert("RGB")
    step = (maps.width - PAD) // 3                       # one tile + its padding; 3 tiles a row
    maps = maps.crop((0, 0, maps.width, MAP_ROWS * step + PAD))
    grids_h = len(rows) * rows[0].height
    scale = grids_h / maps.height
    maps = maps.resize((round(maps.width * scale), round(maps.height * scale)), Image.NEAREST)
    width = LABEL_W + rows[0].width + 16 + maps.width
    height = HEAD + grids_h
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=14)
    for i, (m, row) in enumerate(zip(METHODS, rows)):
        y = HEAD + i * row.height
        canvas.paste(row, (LABEL_W, y))
        draw.text((8, y + row.height // 2 - 8), m, fill="black", font=font)
    draw.text((LABEL_W + 2, 3), "one image per class (seed 0)", fill="black", font=font)
    x = LABEL_W + rows[0].width + 16
    canvas.paste(maps, (x, HEAD))
    draw.text((x + 2, 3), "mulo: image, kept, islands", fill="black", font=font)
    path = os.path.join(HERE, "demo.png")
    canvas.save(path, optimize=True)
    print(f"wrote {path} ({os.path.getsize(path) // 1024} KB, {width}x{height})")


if __name__ == "__main__":
    main()
