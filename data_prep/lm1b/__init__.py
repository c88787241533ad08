"""The One Billion Word benchmark (Figure 5's bigLSTM): official release -> vocabulary + token-id shards."""
