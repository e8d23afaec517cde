"""Where the sampler and the trainer part: per knob setting, the importance-ratio statistics of
responses drawn by the project's sampler and re-scored by the float32 trainer, and the exact KL
between the two distributions (docs/mismatch.md, the atlas made with it).

  knobs.py    Setting (one row: precision, temperature, top-k / top-p, trainer dtype, lag,
              external model) and `parse_setting`
  stats.py    `summarize`: ESS, |log-ratio| quantiles, chi^2, k1, k3, exact KLs, share outside
              [0.8, 1.2], by response length and by pi_b(y); float64 numpy
  replay.py   pi_b's whole distribution along the sampler's decode path, for the exact KLs
  measure.py  the model, the prompts, the sampling and re-scoring of one setting
  report.py   mismatch.json / .md / .png
  cli.py      `python -m ess_jax.mismatch`
"""
