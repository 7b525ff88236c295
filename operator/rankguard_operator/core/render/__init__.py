"""What rankguard applies, rendered from the spec and the flags in effect: the serving Deployment
and its Service (`deployment`), the model cache's claim and the ModelCacheReady condition
(`claim`). Plain dicts in the API's camelCase, for server-side apply."""
