"""The benchmark and training harness: ``dpkernels bench`` and ``dpkernels train``.

Not part of the library API (``import dpkernels`` does not import it); the command line
(:mod:`dpkernels.cli`) and the pytest-benchmark suites in ``benchmarks/`` use it. Modules, each
importing only those listed before it:

- :mod:`~dpkernels.bench.shapes`: the model-shaped per-sample gradient lists;
- :mod:`~dpkernels.bench._timing`: providers, the run's configuration, the backends timed per
  device, the measurement (shuffled rounds, cache flush, other processes' load; on ``--device
  cuda``, CUDA events between synchronizations) and the same-run bandwidth and Opacus baselines;
- :mod:`~dpkernels.bench._report`: result rows, ratios, targets and tables;
- the sections: :mod:`~dpkernels.bench.clip` (``clip``), :mod:`~dpkernels.bench.noise` (``noise``,
  ``privatize``), :mod:`~dpkernels.bench.step` (``step``), :mod:`~dpkernels.bench.train_step`
  (``train``);
- :mod:`~dpkernels.bench.runner`: ``dpkernels bench``, which runs the sections;
- :mod:`~dpkernels.bench.train`: ``dpkernels train``, private training of every algorithm on
  scikit-learn's digits (independent of the others).

The method and the results: docs/BENCHMARKS.md and docs/RESULTS.md.
"""
