{{/*
The GPU Operator's value keys beyond those _helpers.tpl reads directly
(docs/migrating-from-gpu-operator.md, "Helm values"): a values file of the
operator's chart, of any version, is taken whole. "gpu-agent.operatorMap"
says what each key given means for gpu-agent, as YAML:

  policy:  keys of the agents' policy the operator keys set (agent.policy
           is merged over them and wins);
  named:   {reason: [key, ...]}: keys given that gpu-agent does not use,
           which NOTES.txt names with the reason;
  refused: [message, ...]: keys with which gpu-agent would silently do
           something else than what they ask (gpu-agent.validate fails on
           them, naming each).

A key counts as given when its value asks for something: true, a
non-empty string, list or map, a number. An operand switched off
(enabled: false) asks for nothing below it.
*/}}

{{/* Go's strconv.ParseBool, as the toolkit and mig-manager read their
variables: "true", "false", or "" when neither. */}}
{{- define "gpu-agent.parseBool" -}}
{{- $s := toString . -}}
{{- if has $s (list "1" "t" "T" "TRUE" "true" "True") -}}true
{{- else if has $s (list "0" "f" "F" "FALSE" "false" "False") -}}false
{{- end -}}
{{- end -}}

{{/* An operand's env list (name, value | valueFrom), as the operator sets
it on the container (a later entry of a name wins): {values: {name:
value}, from: [names given by valueFrom]}. */}}
{{- define "gpu-agent.envMap" -}}
{{- $vals := dict -}}
{{- $from := list -}}
{{- range (. | default (list)) -}}
{{- if and (kindIs "map" .) .name -}}
{{- $n := toString .name -}}
{{- if hasKey . "valueFrom" -}}
{{- $from = append $from $n -}}
{{- $_ := unset $vals $n -}}
{{- else -}}
{{- $_ := set $vals $n (toString (.value | default "")) -}}
{{- $from = without $from $n -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "values" $vals "from" $from) -}}
{{- end -}}

{{/* Whether a value asks for something ("1…") or not (""). */}}
{{- define "gpu-agent.isSet" -}}
{{- if kindIs "map" . -}}
{{- if not (and (hasKey . "enabled") (kindIs "bool" .enabled) (not .enabled)) -}}
{{- range $_, $x := . -}}{{- include "gpu-agent.isSet" $x -}}{{- end -}}
{{- end -}}
{{- else if or (kindIs "slice" .) (kindIs "bool" .) (kindIs "string" .) -}}
{{- if . -}}1{{- end -}}
{{- else if not (kindIs "invalid" .) -}}1
{{- end -}}
{{- end -}}

{{/* The keys of `v` (a map at path `p`) that `u` (the same level of the
tree of keys gpu-agent reads) does not have and that are given: a YAML
list of paths. */}}
{{- define "gpu-agent.unusedKeys" -}}
{{- $out := list -}}
{{- if not (and (hasKey .v "enabled") (kindIs "bool" .v.enabled) (not .v.enabled)) -}}
{{- range $k, $val := .v -}}
{{- $path := ternary $k (printf "%s.%s" $.p $k) (eq $.p "") -}}
{{- $u := get $.u $k -}}
{{- if kindIs "map" $u -}}
{{- if kindIs "map" $val -}}
{{- $out = concat $out (include "gpu-agent.unusedKeys" (dict "v" $val "u" $u "p" $path) | fromYamlArray) -}}
{{- end -}}
{{- else if $u -}}
{{- else if include "gpu-agent.isSet" $val -}}
{{- $out = append $out $path -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The operator keys gpu-agent reads (1: read here or in _helpers.tpl,
which name what of them they do not use). */}}
{{- define "gpu-agent.operatorKeysRead" -}}
operator: {defaultRuntime: 1, runtimeClass: 1}
driver:
  enabled: 1
  version: 1
  kernelModuleType: 1
  upgradePolicy: 1
  useOpenKernelModules: 1
  usePrecompiled: 1
  rdma: 1
  kernelModuleConfig: {name: 1}
toolkit: {enabled: 1, env: 1}
cdi: {enabled: 1, default: 1}
devicePlugin:
  enabled: 1
  env: 1
  config: {create: 1, name: 1, default: 1, data: 1}
  mps: {root: 1}
mig: {strategy: 1}
migManager:
  enabled: 1
  env: 1
  config: {default: 1, create: 1, name: 1, data: 1}
dcgmExporter:
  enabled: 1
  env: 1
  enablePodLabels: 1
  enablePodUID: 1
  podLabelAllowlistRegex: 1
  config: {create: 1, name: 1, data: 1}
  service: {type: 1, internalTrafficPolicy: 1}
  serviceMonitor: {enabled: 1, interval: 1, scrapeTimeout: 1, honorLabels: 1, additionalLabels: 1, relabelings: 1}
gfd: {enabled: 1}
daemonsets: 1
hostPaths: {rootFS: 1, kubeletRootDir: 1, driverInstallDir: 1}
clusterPolicy: {deployCR: 1, name: 1}
validator: {plugin: {env: 1}, cuda: {env: 1}}
sandboxWorkloads: {enabled: 1, defaultWorkload: 1}
gpuCluster: {deployCR: 1}
extraObjects: 1
{{- end -}}

{{/* Why an operator key gpu-agent does not read is not used, by path. */}}
{{- define "gpu-agent.unusedReason" -}}
{{- $s := splitList "." . -}}
{{- $top := first $s -}}
{{- $leaf := last $s -}}
{{- $image := list "repository" "image" "version" "imagePullPolicy" "imagePullSecrets" "env" "args" "resources" "hostNetwork" "hostPID" "securityContext" "podSecurityContext" "priorityClassName" "tolerations" "nodeSelector" "affinity" "annotations" "labels" "podAnnotations" "podLabels" "startupProbe" "livenessProbe" "readinessProbe" "initContainer" "manager" "driverManager" "serviceAccount" "logging" -}}
{{- $sandbox := list "sandboxWorkloads" "vgpuManager" "vgpuDeviceManager" "vfioManager" "kataManager" "sandboxDevicePlugin" "kataSandboxDevicePlugin" "ccManager" -}}
{{- if has . (list "operator.upgradeCRD" "operator.cleanupCRD") -}}
the operator chart's CRD hooks: gpu-agent's chart has the ClusterPolicy CRD in crds/, which Helm installs once and never upgrades or deletes (after an upgrade: kubectl apply -f packaging/crds/)
{{- else if eq $top "operator" -}}
the GPU Operator's own Deployment: gpu-controller's is set by controller.*
{{- else if eq $top "validator" -}}
the operator's validator pods: each agent validates its own stages (agent.policy.validator, docs/policy.md)
{{- else if has $top (list "nfd" "node-feature-discovery") -}}
gpu-agent deploys no Node Feature Discovery (the operator's goes with it): agents run on the nodes agent.affinity names (NFD's PCI label, nvidia.com/gpu.present, Karpenter's GPU label)
{{- else if eq $top "psa" -}}
the chart does not label its namespace: label it pod-security.kubernetes.io/enforce=privileged (docs/install-kubernetes.md)
{{- else if eq $top "psp" -}}
PodSecurityPolicy is gone since Kubernetes 1.25
{{- else if eq $top "platform" -}}
no OpenShift specifics (SCCs, driver toolkit images)
{{- else if eq $top "dcgm" -}}
no standalone DCGM host engine: the agents read NVML themselves; tools that connect to nv-hostengine (port 5555) need their own
{{- else if eq $top "nodeStatusExporter" -}}
no node status exporter: gpu-agent status and the nodes' GPU conditions say the same
{{- else if has $top (list "gds" "gdrcopy") -}}
no GPUDirect Storage (nvidia-fs) or GDRCopy drivers
{{- else if has $top $sandbox -}}
sandbox workloads (VM passthrough, vGPU, Kata, confidential computing): gpu-agent serves containers only, and nodes whose nvidia.com/gpu.workload.config is a VM's get no agent
{{- else if has $top (list "gpuCluster" "draDriver") -}}
no DRA driver: gpu-agent serves the device-plugin API
{{- else if has $leaf $image -}}
images and pod settings of the operator's operands: gpu-agent runs one image (image.*) in one DaemonSet (agent.*, daemonsets.*)
{{- else if eq $top "driver" -}}
the operator's driver container (precompiled images, package repositories, certificates, vGPU licensing, the NVIDIADriver CRD): gpu-agent installs drivers from bundles on the host (agent.policy.driver.bundle) or uses the host's own
{{- else if eq $top "toolkit" -}}
gpu-agent installs no container toolkit: it writes the runtime's config itself, and its CDI hook is its own binary
{{- else if eq $top "migManager" -}}
mig-manager's host GPU clients (services it stops): gpu-agent waits for GPU processes to exit instead (agent.policy.migManager.gpuClientsTimeoutSeconds)
{{- else if eq $top "dcgmExporter" -}}
dcgm-exporter's own settings, with no counterpart in gpu-agent's metrics
{{- else -}}
not a key gpu-agent reads
{{- end -}}
{{- end -}}

{{- define "gpu-agent.operatorMap" -}}
{{- $v := .Values -}}
{{- $policy := dict -}}
{{- $named := dict -}}
{{- $refused := list -}}
{{- $rc := $v.operator.runtimeClass -}}
{{- $runtime := $v.operator.defaultRuntime | default "containerd" -}}
{{- $deployCR := $v.clusterPolicy.deployCR -}}

{{- /* Keys the walk below does not reach, each named where it asks for
something gpu-agent does not do. */ -}}
{{- $notes := list -}}

{{- /* ---- toolkit.env: the container toolkit's variables ---- */ -}}
{{- $e := include "gpu-agent.envMap" ($v.toolkit | default dict).env | fromYaml -}}
{{- $ev := $e.values | default dict -}}
{{- $read := list "CONTAINERD_CONFIG" "RUNTIME_CONFIG" "DOCKER_CONFIG" "CRIO_CONFIG" "RUNTIME_DROP_IN_CONFIG" "CONTAINERD_SOCKET" "RUNTIME_SOCKET" "DOCKER_SOCKET" "RUNTIME_RESTART_MODE" "CONTAINERD_RESTART_MODE" "NVIDIA_RUNTIME_SET_AS_DEFAULT" "CONTAINERD_SET_AS_DEFAULT" "DOCKER_SET_AS_DEFAULT" "NVIDIA_RUNTIME_NAME" "CONTAINERD_RUNTIME_CLASS" "DOCKER_RUNTIME_NAME" -}}
{{- range $n := ($e.from | default (list)) -}}
{{- if has $n $read -}}
{{- $refused = append $refused (printf "toolkit.env %s: given by valueFrom, which the chart cannot read; it sets the agents' policy, so give it as value" $n) -}}
{{- end -}}
{{- end -}}
{{- $tk := dict -}}
{{- $ctd := dict -}}
{{- $validator := dict -}}
{{- $other := printf "for another container runtime than operator.defaultRuntime (%s): the operator did not use it either" $runtime -}}
{{- $byOperator := "set by the operator itself over the value given" -}}
{{- $consumed := list -}}
{{- /* Paths are host paths. */ -}}
{{- range $n := list "CONTAINERD_CONFIG" "RUNTIME_CONFIG" "DOCKER_CONFIG" "CRIO_CONFIG" "RUNTIME_DROP_IN_CONFIG" "CONTAINERD_SOCKET" "RUNTIME_SOCKET" "DOCKER_SOCKET" -}}
{{- $p := get $ev $n -}}
{{- if and $p (not (hasPrefix "/" $p)) -}}
{{- $refused = append $refused (printf "toolkit.env %s=%s: not an absolute path on the host" $n $p) -}}
{{- end -}}
{{- end -}}
{{- if eq $runtime "containerd" -}}
{{- with (get $ev "CONTAINERD_CONFIG" | default (get $ev "RUNTIME_CONFIG")) -}}
{{- $_ := set $ctd "config" . -}}
{{- end -}}
{{- with get $ev "RUNTIME_DROP_IN_CONFIG" -}}
{{- $_ := set $ctd "dropInDir" (dir .) -}}
{{- end -}}
{{- with get $ev "CONTAINERD_SOCKET" -}}
{{- $_ := set $validator "criSocket" . -}}
{{- end -}}
{{- $consumed = list "CONTAINERD_CONFIG" "RUNTIME_CONFIG" "RUNTIME_DROP_IN_CONFIG" "CONTAINERD_SOCKET" -}}
{{- range $n := list "DOCKER_CONFIG" "CRIO_CONFIG" "DOCKER_SOCKET" -}}
{{- if hasKey $ev $n }}{{ $notes = append $notes (list (printf "toolkit.env %s" $n) $other) }}{{ end -}}
{{- end -}}
{{- if hasKey $ev "RUNTIME_SOCKET" }}{{ $notes = append $notes (list "toolkit.env RUNTIME_SOCKET" (printf "%s (CONTAINERD_SOCKET is the one it read)" $byOperator)) }}{{ end -}}
{{- else if eq $runtime "docker" -}}
{{- with (get $ev "DOCKER_CONFIG" | default (get $ev "RUNTIME_CONFIG")) -}}
{{- if ne . "/etc/docker/daemon.json" -}}
{{- $refused = append $refused (printf "toolkit.env %s=%s: gpu-agent configures Docker through /etc/docker/daemon.json only; a Docker that reads %s would never get the %s runtime" (ternary "DOCKER_CONFIG" "RUNTIME_CONFIG" (hasKey $ev "DOCKER_CONFIG")) . . $rc) -}}
{{- end -}}
{{- end -}}
{{- $consumed = list "DOCKER_CONFIG" "RUNTIME_CONFIG" -}}
{{- range $n := list "CONTAINERD_CONFIG" "CRIO_CONFIG" "CONTAINERD_SOCKET" -}}
{{- if hasKey $ev $n }}{{ $notes = append $notes (list (printf "toolkit.env %s" $n) $other) }}{{ end -}}
{{- end -}}
{{- if hasKey $ev "RUNTIME_DROP_IN_CONFIG" }}{{ $notes = append $notes (list "toolkit.env RUNTIME_DROP_IN_CONFIG" "Docker has no drop-in files; the toolkit ignored it too") }}{{ end -}}
{{- if hasKey $ev "RUNTIME_SOCKET" }}{{ $notes = append $notes (list "toolkit.env RUNTIME_SOCKET" $byOperator) }}{{ end -}}
{{- with get $ev "DOCKER_SOCKET" -}}
{{- if not (has . (list "/var/run/docker.sock" "/run/docker.sock")) -}}
{{- $notes = append $notes (list "toolkit.env DOCKER_SOCKET" "gpu-agent finds dockerd on the host itself to signal it") -}}
{{- end -}}
{{- $consumed = append $consumed "DOCKER_SOCKET" -}}
{{- end -}}
{{- else -}}
{{- with (get $ev "CRIO_CONFIG" | default (get $ev "RUNTIME_CONFIG")) -}}
{{- if ne . "/etc/crio/crio.conf" -}}
{{- $notes = append $notes (list (printf "toolkit.env %s" (ternary "CRIO_CONFIG" "RUNTIME_CONFIG" (hasKey $ev "CRIO_CONFIG"))) "gpu-agent writes only its drop-in /etc/crio/crio.conf.d/99-nvidia.conf, and reads /etc/crio/crio.conf to keep CRI-O's default runtime") -}}
{{- end -}}
{{- end -}}
{{- with get $ev "RUNTIME_DROP_IN_CONFIG" -}}
{{- if ne (dir .) "/etc/crio/crio.conf.d" -}}
{{- $refused = append $refused (printf "toolkit.env RUNTIME_DROP_IN_CONFIG=%s: gpu-agent writes its CRI-O drop-in to /etc/crio/crio.conf.d, which a CRI-O reading drop-ins from %s would not see" . (dir .)) -}}
{{- end -}}
{{- end -}}
{{- with get $ev "RUNTIME_SOCKET" -}}
{{- $_ := set $validator "criSocket" . -}}
{{- end -}}
{{- $consumed = list "CRIO_CONFIG" "RUNTIME_CONFIG" "RUNTIME_DROP_IN_CONFIG" "RUNTIME_SOCKET" -}}
{{- range $n := list "CONTAINERD_CONFIG" "DOCKER_CONFIG" "CONTAINERD_SOCKET" "DOCKER_SOCKET" -}}
{{- if hasKey $ev $n }}{{ $notes = append $notes (list (printf "toolkit.env %s" $n) $other) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- /* Restarting the runtime after a change. */ -}}
{{- $modeVar := ternary "RUNTIME_RESTART_MODE" "CONTAINERD_RESTART_MODE" (hasKey $ev "RUNTIME_RESTART_MODE") -}}
{{- with (get $ev "RUNTIME_RESTART_MODE" | default (get $ev "CONTAINERD_RESTART_MODE")) -}}
{{- if eq . "none" -}}
{{- $_ := set $tk "reload" "none" -}}
{{- else if eq . "systemd" -}}
{{- $_ := set $tk "reload" "restart" -}}
{{- else if eq . "signal" -}}
{{- if eq $runtime "docker" -}}
{{- $_ := set $tk "reload" "signal" -}}
{{- else -}}
{{- $notes = append $notes (list (printf "toolkit.env %s=signal" $modeVar) (printf "gpu-agent restarts %s through systemd after a change of its config (k3s and RKE2: their own unit), never otherwise" $runtime)) -}}
{{- end -}}
{{- else -}}
{{- $refused = append $refused (printf "toolkit.env %s=%s: not signal, systemd or none" $modeVar .) -}}
{{- end -}}
{{- end -}}
{{- /* The nvidia runtime the default. */ -}}
{{- range $n := list "NVIDIA_RUNTIME_SET_AS_DEFAULT" "CONTAINERD_SET_AS_DEFAULT" "DOCKER_SET_AS_DEFAULT" -}}
{{- if and (hasKey $ev $n) (not (hasKey $tk "setAsDefault")) -}}
{{- $b := include "gpu-agent.parseBool" (get $ev $n) -}}
{{- if $b -}}
{{- $_ := set $tk "setAsDefault" (eq $b "true") -}}
{{- else -}}
{{- $refused = append $refused (printf "toolkit.env %s=%s: not true or false" $n (get $ev $n)) -}}
{{- $_ := set $tk "setAsDefault" false -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* The runtime's name: the toolkit takes the first of these that is
set; the operator sets CONTAINERD_RUNTIME_CLASS to operator.runtimeClass
(over a value given here) for containerd. gpu-agent adds one runtime,
named operator.runtimeClass, which the chart's RuntimeClass names too. */ -}}
{{- $nameVars := list "NVIDIA_RUNTIME_NAME" -}}
{{- if eq $runtime "containerd" -}}
{{- with get $ev "CONTAINERD_RUNTIME_CLASS" -}}
{{- if ne . $rc -}}
{{- $notes = append $notes (list "toolkit.env CONTAINERD_RUNTIME_CLASS" (printf "%s (operator.runtimeClass, %s); so does gpu-agent" $byOperator $rc)) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $nameVars = list "NVIDIA_RUNTIME_NAME" "CONTAINERD_RUNTIME_CLASS" "DOCKER_RUNTIME_NAME" -}}
{{- end -}}
{{- $nameVar := "" -}}
{{- range $n := $nameVars -}}
{{- if and (not $nameVar) (get $ev $n) }}{{ $nameVar = $n }}{{ end -}}
{{- end -}}
{{- if and $nameVar (ne (get $ev $nameVar) $rc) -}}
{{- $refused = append $refused (printf "toolkit.env %s=%s: the operator added a runtime named %s while its RuntimeClass (operator.runtimeClass) is %s; gpu-agent adds one runtime, named after operator.runtimeClass: set operator.runtimeClass: %s" $nameVar (get $ev $nameVar) (get $ev $nameVar) $rc (get $ev $nameVar)) -}}
{{- end -}}
{{- $consumed = concat $consumed (list "RUNTIME_RESTART_MODE" "CONTAINERD_RESTART_MODE" "NVIDIA_RUNTIME_SET_AS_DEFAULT" "CONTAINERD_SET_AS_DEFAULT" "DOCKER_SET_AS_DEFAULT" "NVIDIA_RUNTIME_NAME" "CONTAINERD_RUNTIME_CLASS" "DOCKER_RUNTIME_NAME") -}}
{{- $notedNames := list -}}
{{- range $x := $notes }}{{ $notedNames = append $notedNames (index $x 0) }}{{ end -}}
{{- range $n, $_ := $ev -}}
{{- if and (not (has $n $consumed)) (not (has (printf "toolkit.env %s" $n) $notedNames)) (not (has (printf "toolkit.env %s=signal" $n) $notedNames)) -}}
{{- if has $n (list "RUNTIME_CONFIG_SOURCE" "RUNTIME_CONFIG_SOURCES") -}}
{{- $notes = append $notes (list (printf "toolkit.env %s" $n) "gpu-agent reads the config it changes itself (for a k3s or RKE2 template, the config.toml they render beside it)") -}}
{{- else if has $n (list "RUNTIME" "RUNTIME_DROP_IN_CONFIG_HOST_PATH" "RUNTIME_SOCKET") -}}
{{- $notes = append $notes (list (printf "toolkit.env %s" $n) $byOperator) -}}
{{- else -}}
{{- $notes = append $notes (list (printf "toolkit.env %s" $n) "the toolkit installer's own settings: gpu-agent installs no toolkit and configures the runtime itself") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $n := ($e.from | default (list)) -}}
{{- if not (has $n $read) -}}
{{- $notes = append $notes (list (printf "toolkit.env %s" $n) "the toolkit installer's own settings: gpu-agent installs no toolkit and configures the runtime itself") -}}
{{- end -}}
{{- end -}}
{{- if $ctd }}{{ $_ := set $tk "containerd" $ctd }}{{ end -}}
{{- if $tk }}{{ $_ := set $policy "toolkit" $tk }}{{ end -}}

{{- /* ---- devicePlugin.env: NVIDIA device plugin's variables ---- */ -}}
{{- $e = include "gpu-agent.envMap" ($v.devicePlugin | default dict).env | fromYaml -}}
{{- $ev = $e.values | default dict -}}
{{- $dp := dict -}}
{{- $dpRead := list "DEVICE_LIST_STRATEGY" "DEVICE_ID_STRATEGY" "PASS_DEVICE_SPECS" "CDI_ANNOTATION_PREFIX" "MIG_STRATEGY" -}}
{{- range $n := ($e.from | default (list)) -}}
{{- if has $n $dpRead -}}
{{- $refused = append $refused (printf "devicePlugin.env %s: given by valueFrom, which the chart cannot read; it sets the agents' policy, so give it as value" $n) -}}
{{- else -}}
{{- $notes = append $notes (list (printf "devicePlugin.env %s" $n) "the NVIDIA device plugin's own settings, with no counterpart in gpu-agent's (agent.policy.devicePlugin, the device-plugin config)") -}}
{{- end -}}
{{- end -}}
{{- range $n, $x := $ev -}}
{{- if eq $n "DEVICE_LIST_STRATEGY" -}}
{{- $l := splitList "," $x -}}
{{- $_ := set $dp "deviceListStrategy" (ternary (first $l) $l (eq (len $l) 1)) -}}
{{- else if eq $n "DEVICE_ID_STRATEGY" -}}
{{- $_ := set $dp "deviceIdStrategy" $x -}}
{{- else if eq $n "CDI_ANNOTATION_PREFIX" -}}
{{- $_ := set $dp "cdiAnnotationPrefix" $x -}}
{{- else if eq $n "PASS_DEVICE_SPECS" -}}
{{- $b := include "gpu-agent.parseBool" $x -}}
{{- if $b }}{{ $_ := set $dp "passDeviceSpecs" (eq $b "true") }}{{ else }}{{ $refused = append $refused (printf "devicePlugin.env PASS_DEVICE_SPECS=%s: not true or false" $x) }}{{ end -}}
{{- else if eq $n "MIG_STRATEGY" -}}
{{- if ne $x $v.mig.strategy -}}
{{- $refused = append $refused (printf "devicePlugin.env MIG_STRATEGY=%s: the operator's device plugin advertised MIG devices as %s while its labels said mig.strategy %s; gpu-agent has one strategy: set mig.strategy: %s" $x $x $v.mig.strategy $x) -}}
{{- end -}}
{{- else -}}
{{- $notes = append $notes (list (printf "devicePlugin.env %s" $n) "the NVIDIA device plugin's own settings, with no counterpart in gpu-agent's (agent.policy.devicePlugin, the device-plugin config)") -}}
{{- end -}}
{{- end -}}
{{- if $dp }}{{ $_ := set $policy "devicePlugin" $dp }}{{ end -}}
{{- with ($v.devicePlugin | default dict).mps -}}
{{- if and .root (ne (toString .root) "/run/nvidia/mps") -}}
{{- $notes = append $notes (list "devicePlugin.mps.root" "gpu-agent's MPS root is flags.mpsRoot of the device-plugin config (default /run/nvidia/mps)") -}}
{{- end -}}
{{- end -}}

{{- /* ---- migManager.env ---- */ -}}
{{- $e = include "gpu-agent.envMap" ($v.migManager | default dict).env | fromYaml -}}
{{- $ev = $e.values | default dict -}}
{{- range $n := ($e.from | default (list)) -}}
{{- if eq $n "WITH_REBOOT" -}}
{{- $refused = append $refused "migManager.env WITH_REBOOT: given by valueFrom, which the chart cannot read; it sets the agents' policy, so give it as value" -}}
{{- else -}}
{{- $notes = append $notes (list (printf "migManager.env %s" $n) "mig-manager's own settings, with no counterpart in gpu-agent's (agent.policy.migManager)") -}}
{{- end -}}
{{- end -}}
{{- range $n, $x := $ev -}}
{{- if eq $n "WITH_REBOOT" -}}
{{- $b := include "gpu-agent.parseBool" $x -}}
{{- if $b }}{{ $_ := set $policy "migManager" (dict "reboot" (eq $b "true")) }}{{ else }}{{ $refused = append $refused (printf "migManager.env WITH_REBOOT=%s: not true or false" $x) }}{{ end -}}
{{- else -}}
{{- $notes = append $notes (list (printf "migManager.env %s" $n) "mig-manager's own settings, with no counterpart in gpu-agent's (agent.policy.migManager)") -}}
{{- end -}}
{{- end -}}

{{- $mmc := ($v.migManager | default dict).config | default dict -}}
{{- if and (eq (toString $mmc.name) "default-mig-parted-config") (not $mmc.create) -}}
{{- $notes = append $notes (list "migManager.config.name=default-mig-parted-config" "the operator's own default layouts, a ConfigMap it made and takes with it: gpu-agent's built-in layouts (the same names) stand for it") -}}
{{- end -}}

{{- /* ---- dcgmExporter ---- */ -}}
{{- $dcgmx := $v.dcgmExporter | default dict -}}
{{- $e = include "gpu-agent.envMap" $dcgmx.env | fromYaml -}}
{{- $ev = $e.values | default dict -}}
{{- range $n := ($e.from | default (list)) -}}
{{- if eq $n "DCGM_EXPORTER_INTERVAL" -}}
{{- $refused = append $refused "dcgmExporter.env DCGM_EXPORTER_INTERVAL: given by valueFrom, which the chart cannot read; it sets the agents' policy, so give it as value" -}}
{{- else -}}
{{- $notes = append $notes (list (printf "dcgmExporter.env %s" $n) "dcgm-exporter's own settings, with no counterpart in gpu-agent's metrics") -}}
{{- end -}}
{{- end -}}
{{- range $n, $x := $ev -}}
{{- if eq $n "DCGM_EXPORTER_INTERVAL" -}}
{{- if regexMatch "^[0-9]+$" $x -}}
{{- $_ := set $policy "dcgmExporter" (dict "collectIntervalMs" (atoi $x)) -}}
{{- else -}}
{{- $refused = append $refused (printf "dcgmExporter.env DCGM_EXPORTER_INTERVAL=%s: not a number of milliseconds" $x) -}}
{{- end -}}
{{- else if eq $n "DCGM_EXPORTER_COLLECTORS" -}}
{{- $notes = append $notes (list "dcgmExporter.env DCGM_EXPORTER_COLLECTORS" "a counters file in dcgm-exporter's image or its mounts: give gpu-agent the file with dcgmExporter.config") -}}
{{- else -}}
{{- $notes = append $notes (list (printf "dcgmExporter.env %s" $n) "dcgm-exporter's own settings, with no counterpart in gpu-agent's metrics") -}}
{{- end -}}
{{- end -}}
{{- range $k := list "enablePodLabels" "enablePodUID" "podLabelAllowlistRegex" -}}
{{- if include "gpu-agent.isSet" (get $dcgmx $k) -}}
{{- $notes = append $notes (list (printf "dcgmExporter.%s" $k) "the series carry pod, namespace and container from the kubelet's pod-resources API; the agents hold no API credentials, so not the pods' labels or UID") -}}
{{- end -}}
{{- end -}}

{{- /* ---- driver ---- */ -}}
{{- $drv := $v.driver | default dict -}}
{{- $d := dict -}}
{{- with $drv.rdma -}}
{{- if .enabled }}{{ $_ := set $d "peermem" true }}{{ end -}}
{{- if and .enabled .useHostMofed -}}
{{- $notes = append $notes (list "driver.rdma.useHostMofed" "gpu-agent installs no MOFED driver: nvidia-peermem needs the host's") -}}
{{- end -}}
{{- end -}}
{{- with ($drv.kernelModuleConfig | default dict).name -}}
{{- $_ := set $d "kernelModuleConfig" (dict "name" .) -}}
{{- if not $deployCR -}}
{{- $notes = append $notes (list "driver.kernelModuleConfig.name" "gpu-controller reads this ConfigMap from a ClusterPolicy only (clusterPolicy.deployCR: true); otherwise give the parameters in agent.policy.driver.kernelModuleConfig") -}}
{{- end -}}
{{- end -}}
{{- if and $drv.upgradePolicy (not $deployCR) (include "gpu-agent.isSet" $drv.upgradePolicy) -}}
{{- $notes = append $notes (list "driver.upgradePolicy" "gpu-controller runs driver rollouts from a ClusterPolicy only (clusterPolicy.deployCR: true); without one, each agent installs a changed bundle on its own node, waiting for its GPU processes") -}}
{{- end -}}
{{- if $drv.usePrecompiled -}}
{{- $notes = append $notes (list "driver.usePrecompiled" "gpu-agent installs drivers from bundles on the host (agent.policy.driver.bundle), not from precompiled driver images") -}}
{{- end -}}
{{- if $drv.useOpenKernelModules -}}
{{- $notes = append $notes (list "driver.useOpenKernelModules" "deprecated by the GPU Operator and a no-op there since v25.3: driver.kernelModuleType says it") -}}
{{- end -}}
{{- if $d }}{{ $_ := set $policy "driver" $d }}{{ end -}}

{{- /* ---- validator.{plugin,cuda}.env WITH_WORKLOAD ---- */ -}}
{{- $val := $v.validator | default dict -}}
{{- range $c := list "plugin" "cuda" -}}
{{- $e = include "gpu-agent.envMap" ((get $val $c) | default dict).env | fromYaml -}}
{{- range $n := ($e.from | default (list)) -}}
{{- if eq $n "WITH_WORKLOAD" -}}
{{- $refused = append $refused (printf "validator.%s.env WITH_WORKLOAD: given by valueFrom, which the chart cannot read; it sets the agents' policy, so give it as value" $c) -}}
{{- else -}}
{{- $notes = append $notes (list (printf "validator.%s.env %s" $c $n) (include "gpu-agent.unusedReason" "validator")) -}}
{{- end -}}
{{- end -}}
{{- range $n, $x := ($e.values | default dict) -}}
{{- if eq $n "WITH_WORKLOAD" -}}
{{- $b := include "gpu-agent.parseBool" $x -}}
{{- if eq $b "true" -}}
{{- $_ := set $validator "workload" true -}}
{{- else if not $b -}}
{{- $refused = append $refused (printf "validator.%s.env WITH_WORKLOAD=%s: not true or false" $c $x) -}}
{{- end -}}
{{- else -}}
{{- $notes = append $notes (list (printf "validator.%s.env %s" $c $n) (include "gpu-agent.unusedReason" "validator")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $validator }}{{ $_ := set $policy "validator" $validator }}{{ end -}}

{{- /* ---- hostPaths.driverInstallDir ---- */ -}}
{{- with ($v.hostPaths | default dict).driverInstallDir -}}
{{- $dirv := trimSuffix "/" (toString .) | default "/" -}}
{{- if eq $dirv "/run/nvidia/driver" -}}
{{- $notes = append $notes (list "hostPaths.driverInstallDir" "the operator's driver container's root: gpu-agent uses the driver on the host's own root (/), where its bundles install") -}}
{{- else if ne $dirv "/" -}}
{{- $refused = append $refused (printf "hostPaths.driverInstallDir=%s: gpu-agent looks for the driver's libraries and programs on the host's root (its ld.so.conf directories and the usual ones) and under /run/nvidia/driver, not under %s: containers would get no driver from it" . .) -}}
{{- end -}}
{{- end -}}

{{- /* ---- operands and modes gpu-agent does not have ---- */ -}}
{{- if and $v.gpuCluster $v.gpuCluster.deployCR -}}
{{- $refused = append $refused "gpuCluster.deployCR: gpu-agent has no DRA driver (GPUCluster, gpu.nvidia.com devices): resource claims for them would stay pending; it serves the device-plugin API (nvidia.com/gpu)" -}}
{{- end -}}
{{- if eq (toString $v.operator.defaultRuntime) "docker" -}}
{{- $notes = append $notes (list "operator.defaultRuntime=docker" "the GPU Operator used it only where it could not tell a node's runtime; gpu-agent configures Docker on every node (on containerd nodes its runtime stage waits, saying there is no Docker)") -}}
{{- end -}}
{{- with $v.sandboxWorkloads -}}
{{- if .enabled -}}
{{- $notes = append $notes (list "sandboxWorkloads.enabled" (printf "the agents run only on nodes whose nvidia.com/gpu.workload.config is container%s; gpu-agent has no VM passthrough, vGPU, KubeVirt or Kata support" (ternary " (or unset)" "" (eq (.defaultWorkload | default "container") "container")))) -}}
{{- end -}}
{{- end -}}

{{- /* ---- every other key given: the walk ---- */ -}}
{{- $own := list "global" "image" "imagePullSecrets" "agent" "controller" "uninstall" "runtimeClass" "metricsService" "nodeSelector" -}}
{{- $walk := dict -}}
{{- range $k, $x := $v -}}
{{- if not (has $k $own) -}}
{{- $_ := set $walk $k $x -}}
{{- end -}}
{{- end -}}
{{- if not ($v.sandboxWorkloads | default dict).enabled -}}
{{- range $k := list "vgpuManager" "vgpuDeviceManager" "vfioManager" "kataManager" "sandboxDevicePlugin" "kataSandboxDevicePlugin" "ccManager" -}}
{{- $_ := unset $walk $k -}}
{{- end -}}
{{- end -}}
{{- if not ($v.gpuCluster | default dict).deployCR }}{{ $_ := unset $walk "draDriver" }}{{ end -}}
{{- if not ($v.nfd | default dict).enabled }}{{ $_ := unset $walk "node-feature-discovery" }}{{ end -}}
{{- $readTree := include "gpu-agent.operatorKeysRead" . | fromYaml -}}
{{- /* Sections gpu-agent reads nothing of, named key by key. */ -}}
{{- range $k := list "nfd" "psa" "psp" "dcgm" "platform" "nodeStatusExporter" "gds" "gdrcopy" -}}
{{- $_ := set $readTree $k (dict) -}}
{{- end -}}
{{- range $p := include "gpu-agent.unusedKeys" (dict "v" $walk "u" $readTree "p" "") | fromYamlArray -}}
{{- $notes = append $notes (list $p (include "gpu-agent.unusedReason" $p)) -}}
{{- end -}}
{{- range $x := $notes -}}
{{- $r := index $x 1 -}}
{{- $_ := set $named $r (append (get $named $r | default (list)) (index $x 0)) -}}
{{- end -}}
{{- toYaml (dict "policy" $policy "named" $named "refused" $refused) -}}
{{- end -}}
