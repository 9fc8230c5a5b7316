"""The layer-by-layer calibration engine every one-shot method shares.

``engine`` (the loop over decoder layers and :class:`~lmpress.calib.engine.CalibrationMethod`),
``session`` (one layer's passes, replay of finished blocks, what methods modify),
``hooks`` (the forward hooks those passes use), ``state`` (resumable state),
``activations`` (slabs of activations between passes), ``pages`` (giving memory back),
``statistics`` (Hessians, their damped inverse factor, input norms), ``moe`` (unfusing experts).
Nothing is imported here, so that the quantizers' tensor math can import
``calib.statistics`` without pulling in the engine.
"""
