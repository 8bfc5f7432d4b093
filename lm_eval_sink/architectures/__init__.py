"""Architecture data for `lm_eval_sink.extract`: one JSON file per VLM family (package data)."""
