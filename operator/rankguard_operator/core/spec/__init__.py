"""An LLMService's spec, parsed and checked: its syntax and the rules of the image's vLLM command
line, every failure a `SpecError` naming the field. `parse` reads the spec section by section,
`fields` one field, `pod` the sections that shape the serving pod, `template` the user's part of
it, and `crd` holds what the CRD fixes (defaults, enums, bounds). What the model makes of a spec
(a split its heads cannot take, say) is the model room's."""
