"""An LLMService's `.status`: built from one pass's figures (`build`), read back as the state a
pass starts from (`service_state`), the engine's own account and the EngineRules condition
(`engine`), what an SRE watches as metrics (`figures`), one Event per change of Degraded
(`degraded`), and written only when something changed (`patch`)."""
