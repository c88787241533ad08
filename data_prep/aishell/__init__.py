"""AISHELL-1 (Mandarin speech, stand-in for DeepSpeech 2's internal Mandarin data; Table 3, Figure 2):
`python -m data_prep.aishell --archives DIR --out DIR`."""
