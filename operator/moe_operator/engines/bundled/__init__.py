"""The bundled runtime (moe-runtime): vocab (accepted values), plan (moe_core.resolve_bundled), engine."""
