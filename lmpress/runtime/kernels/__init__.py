"""Device kernels for lmpress's runtime, one module per device."""
