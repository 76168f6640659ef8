"""The sglang engine: vocab (accepted values), plan (selection rows, validate rows, split rules), engine."""
