-- Argo CD health check for moe.serving.dev/MoEDeployment (shipped in the moe-operator chart).
--
-- Install: add it to argocd-cm under the key resource.customizations.health.moe.serving.dev_MoEDeployment
-- (docs/observability.md has the kubectl patch). Argo CD runs it with only the base, table and
-- package libraries (no string or math): keep it to plain Lua.
--
-- It reads the operator's summary conditions (operator/moe_operator/conditions.py):
--   status.observedGeneration behind metadata.generation -> Progressing (the spec is not seen yet)
--   Stalled=True      -> Degraded    (refused, no feasible GPU class, missing CRD or endpoint picker, ...)
--   Reconciling=True  -> Progressing (inspecting, model cache filling, pods starting, a roll)
--   Ready=True        -> Healthy
--   anything else     -> Progressing
-- A condition written for an older generation counts as absent.
local hs = { status = "Progressing", message = "waiting for the operator to report status" }
if obj.status == nil then
  return hs
end
local gen = obj.metadata.generation
if gen ~= nil and obj.status.observedGeneration ~= gen then
  hs.message = "waiting for the operator to observe generation " .. tostring(gen)
  return hs
end
local conds = {}
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if c.type ~= nil and (gen == nil or c.observedGeneration == nil or c.observedGeneration == gen) then
      conds[c.type] = c
    end
  end
end
local function say(c)
  local reason = c.reason or c.type
  if c.message ~= nil and c.message ~= "" then
    return reason .. ": " .. c.message
  end
  return reason
end
local stalled, reconciling, ready = conds["Stalled"], conds["Reconciling"], conds["Ready"]
if stalled ~= nil and stalled.status == "True" then
  return { status = "Degraded", message = say(stalled) }
end
if reconciling ~= nil and reconciling.status == "True" then
  return { status = "Progressing", message = say(reconciling) }
end
if ready ~= nil and ready.status == "True" then
  return { status = "Healthy", message = say(ready) }
end
if ready ~= nil then
  return { status = "Progressing", message = say(ready) }
end
return hs
