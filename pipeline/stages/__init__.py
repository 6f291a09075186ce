"""The stage kinds: every module of this package that defines `KIND` (or `KINDS`, several kinds of one code path)
registers it (`pipeline.settings.kinds` finds them); nothing else lists them. A kind (`pipeline.settings.StageKind`)
trains exactly one model per call into `ctx.out_dir/model` (a sweep calls it once per candidate,
`pipeline.chain.sweep`). Kind modules are light to import: their training libraries are imported by the functions
that train.
"""
