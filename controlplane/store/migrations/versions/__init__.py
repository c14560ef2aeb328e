"""One module per schema revision; revision ids are "0001", "0002", ... in order."""
