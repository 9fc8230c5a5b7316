"""Weight quantization: the shared integer grid (scheme), packed layers, and the methods."""
