"""LibriSpeech (English speech, stand-in for DeepSpeech 2's internal English data; Table 3):
`python -m data_prep.librispeech --archives DIR --out DIR`."""
