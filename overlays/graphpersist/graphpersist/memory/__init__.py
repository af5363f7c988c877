"""Device memory: the fixed address region and its interposer (../native), setup phases and their anchors,
declared state and tensors at recorded addresses."""
