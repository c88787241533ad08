"""WMT15 English-French (Figure 4): official archives -> SentencePiece id files; a tiny synthetic set."""
