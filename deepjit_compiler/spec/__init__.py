"""The spec language: a pipeline YAML in, a validated `LoadedSpec` out (`load_spec`).
Every problem is a SpecError naming file:line:col, the field, what is allowed and the closest name."""
