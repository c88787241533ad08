"""CelebA (aligned faces) for DCGAN, Figure 6: `python -m data_prep.celeba --archives DIR --out DIR`."""
