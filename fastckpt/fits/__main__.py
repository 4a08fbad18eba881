"""`python -m fastckpt.fits`: the report for a model and memory sizes (fastckpt.fits.main)."""

from fastckpt.fits import main

main()
