{{/*
Names. One release per cluster: the RuntimeClass, the ClusterRole and the
CRD are cluster-wide, and one agent runs per node.
*/}}
{{- define "gpu-agent.agentName" -}}
{{- .Values.agent.name -}}
{{- end -}}

{{- define "gpu-agent.controllerName" -}}
{{- .Values.controller.name -}}
{{- end -}}

{{/* The image both workloads run. */}}
{{- define "gpu-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "gpu-agent.labels" -}}
app.kubernetes.io/part-of: gpu-agent
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "gpu-agent.agentSelector" -}}
app.kubernetes.io/name: {{ include "gpu-agent.agentName" . }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "gpu-agent.controllerSelector" -}}
app.kubernetes.io/name: {{ include "gpu-agent.controllerName" . }}
app.kubernetes.io/component: controller
{{- end -}}

{{/* The kubelet's root directory on the host. */}}
{{- define "gpu-agent.kubeletRootDir" -}}
{{- .Values.hostPaths.kubeletRootDir | default "/var/lib/kubelet" | trimSuffix "/" -}}
{{- end -}}

{{/* Where agents reach the controller, and the name its certificate carries. */}}
{{- define "gpu-agent.controllerHost" -}}
{{- printf "%s.%s.svc" (include "gpu-agent.controllerName" .) .Release.Namespace -}}
{{- end -}}

{{/*
Where the config ConfigMaps are mounted in the agent (the policy names files
by these paths; the agent reads them in its own filesystem).
*/}}
{{- define "gpu-agent.devicePluginDir" -}}/etc/gpu-agent/device-plugin{{- end -}}
{{- define "gpu-agent.migPartedDir" -}}/etc/gpu-agent/mig-parted{{- end -}}
{{- define "gpu-agent.dcgmExporterDir" -}}/etc/gpu-agent/dcgm-exporter{{- end -}}

{{/* The ConfigMaps named by the operator keys, or made by this chart. */}}
{{- define "gpu-agent.devicePluginConfigMap" -}}
{{- $c := .Values.devicePlugin.config -}}
{{- if $c.create -}}
{{- $c.name | default (printf "%s-device-plugin-config" (include "gpu-agent.agentName" .)) -}}
{{- else -}}
{{- $c.name -}}
{{- end -}}
{{- end -}}

{{/*
The operator's chart (v23.3 to v24.3) named its own default layouts,
default-mig-parted-config, a ConfigMap the operator made and takes with it:
gpu-agent's built-in layouts stand for it.
*/}}
{{- define "gpu-agent.migPartedConfigMap" -}}
{{- $c := .Values.migManager.config -}}
{{- if $c.create -}}
{{- $c.name | default (printf "%s-mig-parted-config" (include "gpu-agent.agentName" .)) -}}
{{- else if ne $c.name "default-mig-parted-config" -}}
{{- $c.name -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.dcgmExporterConfigMap" -}}
{{- $c := .Values.dcgmExporter.config -}}
{{- if $c.create -}}
{{- $c.name | default (printf "%s-dcgm-exporter-config" (include "gpu-agent.agentName" .)) -}}
{{- else -}}
{{- $c.name -}}
{{- end -}}
{{- end -}}

{{/* The device-plugin config entry the agent reads. */}}
{{- define "gpu-agent.devicePluginEntry" -}}
{{- $c := .Values.devicePlugin.config -}}
{{- if $c.default -}}
{{- if and $c.create (not (hasKey $c.data $c.default)) -}}
{{- fail (printf "devicePlugin.config.default: %q is not an entry of devicePlugin.config.data (it has: %s)" $c.default (keys $c.data | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $c.default -}}
{{- else if and $c.create (eq (len $c.data) 1) -}}
{{- keys $c.data | first -}}
{{- else -}}
{{- fail "devicePlugin.config.default: name the entry of the device-plugin ConfigMap the agents use (the per-node nvidia.com/device-plugin.config label is not read)" -}}
{{- end -}}
{{- end -}}

{{/*
The agent's policy (docs/policy.md), as a dict: the operator keys, then
agent.policy merged over them.
*/}}
{{- define "gpu-agent.policySpec" -}}
{{- $v := .Values -}}
{{- $operator := dict "runtimeClass" $v.operator.runtimeClass -}}
{{- with $v.operator.defaultRuntime }}{{ $_ := set $operator "defaultRuntime" . }}{{ end -}}
{{- $driver := dict "enabled" $v.driver.enabled -}}
{{- with $v.driver.version }}{{ $_ := set $driver "version" (toString .) }}{{ end -}}
{{- if eq $v.driver.kernelModuleType "open" }}{{ $_ := set $driver "useOpenKernelModules" true }}{{ end -}}
{{- if eq $v.driver.kernelModuleType "proprietary" }}{{ $_ := set $driver "useOpenKernelModules" false }}{{ end -}}
{{- $devicePlugin := dict "enabled" $v.devicePlugin.enabled -}}
{{- $dpc := $v.devicePlugin.config -}}
{{- if or $dpc.create $dpc.name -}}
{{- $entry := include "gpu-agent.devicePluginEntry" . -}}
{{- $_ := set $devicePlugin "config" (dict "name" (include "gpu-agent.devicePluginConfigMap" .) "default" $entry "file" (printf "%s/%s" (include "gpu-agent.devicePluginDir" .) $entry)) -}}
{{- end -}}
{{- $migManager := dict "enabled" $v.migManager.enabled -}}
{{- $mmc := $v.migManager.config -}}
{{- $migConfig := dict -}}
{{- with $mmc.default }}{{ $_ := set $migConfig "default" . }}{{ end -}}
{{- if include "gpu-agent.migPartedConfigMap" . -}}
{{- $_ := set $migConfig "name" (include "gpu-agent.migPartedConfigMap" .) -}}
{{- $_ := set $migConfig "file" (printf "%s/config.yaml" (include "gpu-agent.migPartedDir" .)) -}}
{{- end -}}
{{- if $migConfig }}{{ $_ := set $migManager "config" $migConfig }}{{ end -}}
{{- $dcgm := dict "enabled" $v.dcgmExporter.enabled "listen" (printf ":%d" (int $v.agent.metricsPort)) -}}
{{- $dcc := $v.dcgmExporter.config -}}
{{- if or $dcc.create $dcc.name -}}
{{- $_ := set $dcgm "config" (printf "%s/dcgm-metrics.csv" (include "gpu-agent.dcgmExporterDir" .)) -}}
{{- end -}}
{{- $spec := dict
  "operator" $operator
  "driver" $driver
  "toolkit" (dict "enabled" $v.toolkit.enabled)
  "cdi" (dict "enabled" $v.cdi.enabled "default" $v.cdi.default)
  "devicePlugin" $devicePlugin
  "mig" (dict "strategy" $v.mig.strategy)
  "migManager" $migManager
  "dcgmExporter" $dcgm
  "gfd" (dict "enabled" $v.gfd.enabled)
-}}
{{- $spec = mustMergeOverwrite $spec (include "gpu-agent.operatorMap" . | fromYaml).policy -}}
{{- $spec = mustMergeOverwrite $spec (deepCopy ($v.agent.policy | default dict)) -}}
{{- toYaml $spec -}}
{{- end -}}

{{/* Checks of values that span keys (the schema checks each key alone). */}}
{{- define "gpu-agent.validate" -}}
{{- $v := .Values -}}
{{- if and $v.devicePlugin.config.create (not $v.devicePlugin.config.data) -}}
{{- fail "devicePlugin.config.data: devicePlugin.config.create makes a ConfigMap from data, which is empty" -}}
{{- end -}}
{{- if and $v.migManager.config.create (not (hasKey $v.migManager.config.data "config.yaml")) -}}
{{- fail "migManager.config.data: migManager.config.create needs the layouts under the key config.yaml" -}}
{{- end -}}
{{- if and $v.dcgmExporter.config.create (not $v.dcgmExporter.config.data) -}}
{{- fail "dcgmExporter.config.data: dcgmExporter.config.create makes a ConfigMap from data, which is empty" -}}
{{- end -}}
{{- $always := eq (toString $v.dcgmExporter.serviceMonitor.enabled) "always" -}}
{{- if and $always (not $v.metricsService.enabled) -}}
{{- fail "dcgmExporter.serviceMonitor.enabled: always: the ServiceMonitor scrapes the metrics Service; set metricsService.enabled too" -}}
{{- end -}}
{{- if and $always (not $v.dcgmExporter.enabled) -}}
{{- fail "dcgmExporter.serviceMonitor.enabled: always: the agents serve no metrics (dcgmExporter.enabled is false)" -}}
{{- end -}}
{{- with (include "gpu-agent.operatorMap" . | fromYaml).refused -}}
{{- fail (printf "GPU Operator values gpu-agent cannot honour:\n- %s" (join "\n- " .)) -}}
{{- end -}}
{{- end -}}

{{/*
The metrics Service and ServiceMonitor: the GPU Operator's names
(metricsService.gpuOperatorNames) or gpu-agent's own.
*/}}
{{- define "gpu-agent.metricsServiceName" -}}
{{- if .Values.metricsService.gpuOperatorNames -}}
nvidia-dcgm-exporter
{{- else -}}
{{- include "gpu-agent.agentName" . }}-metrics
{{- end -}}
{{- end -}}

{{- define "gpu-agent.metricsPortName" -}}
{{- ternary "gpu-metrics" "metrics" (.Values.metricsService.gpuOperatorNames | default false) -}}
{{- end -}}

{{/*
Whether the ServiceMonitor is rendered ("true" or ""): serviceMonitor.enabled
true (the operator's default) where the API server serves the Prometheus
Operator's ServiceMonitor kind, "always" whether or not, false never; and
only over a metrics Service.
*/}}
{{- define "gpu-agent.serviceMonitorOn" -}}
{{- $v := .Values -}}
{{- $sm := toString $v.dcgmExporter.serviceMonitor.enabled -}}
{{- if and $v.metricsService.enabled $v.dcgmExporter.enabled -}}
{{- if or (eq $sm "always") (and (eq $sm "true") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The agents' node affinity: agent.affinity, and with the operator's
sandboxWorkloads.enabled only the nodes whose workload (the label
nvidia.com/gpu.workload.config, else sandboxWorkloads.defaultWorkload) is
container, as the operator runs its container operands. YAML, or "".
*/}}
{{- define "gpu-agent.affinity" -}}
{{- $a := deepCopy (.Values.agent.affinity | default dict) -}}
{{- $sw := .Values.sandboxWorkloads | default dict -}}
{{- if $sw.enabled -}}
{{- $expr := dict "key" "nvidia.com/gpu.workload.config" "operator" "In" "values" (list "container") -}}
{{- if eq ($sw.defaultWorkload | default "container") "container" -}}
{{- $expr = dict "key" "nvidia.com/gpu.workload.config" "operator" "NotIn" "values" (list "vm-passthrough" "vm-vgpu") -}}
{{- end -}}
{{- $na := $a.nodeAffinity | default dict -}}
{{- $req := get $na "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := list -}}
{{- range ($req.nodeSelectorTerms | default (list)) -}}
{{- $t := deepCopy . -}}
{{- $_ := set $t "matchExpressions" (append ($t.matchExpressions | default (list)) $expr) -}}
{{- $terms = append $terms $t -}}
{{- end -}}
{{- if not $terms }}{{ $terms = list (dict "matchExpressions" (list $expr)) }}{{ end -}}
{{- $_ := set $req "nodeSelectorTerms" $terms -}}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" $req -}}
{{- $_ := set $a "nodeAffinity" $na -}}
{{- end -}}
{{- if $a }}{{ toYaml $a }}{{ end -}}
{{- end -}}

{{/*
The controller's TLS Secret data (tls.crt, tls.key, ca.crt; base64) in
controller.tls.mode helm: the Secret already in the cluster when it has all
three (so upgrades keep the certificate agents trust), else a new CA and a
serving certificate for the controller's Service names. Called once per
render (controller-deployment.yaml), which uses it for the Secret and the
pods' checksum.
*/}}
{{- define "gpu-agent.tlsData" -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace .Values.controller.tls.secretName -}}
{{- $oldData := (get (default dict $old) "data") | default dict -}}
{{- if and (hasKey $oldData "tls.crt") (hasKey $oldData "tls.key") (hasKey $oldData "ca.crt") -}}
ca.crt: {{ index $oldData "ca.crt" }}
tls.crt: {{ index $oldData "tls.crt" }}
tls.key: {{ index $oldData "tls.key" }}
{{- else -}}
{{- $host := include "gpu-agent.controllerHost" . -}}
{{- $svc := include "gpu-agent.controllerName" . -}}
{{- $days := int .Values.controller.tls.validityDays -}}
{{- $ca := genCA "gpu-controller CA" $days -}}
{{- $names := list $host (printf "%s.cluster.local" $host) $svc (printf "%s.%s" $svc .Release.Namespace) -}}
{{- $cert := genSignedCert $host nil $names $days $ca -}}
ca.crt: {{ $ca.Cert | b64enc }}
tls.crt: {{ $cert.Cert | b64enc }}
tls.key: {{ $cert.Key | b64enc }}
{{- end -}}
{{- end -}}

{{/*
The uninstall hook's objects. Neither they nor its per-node pods
(component node-uninstall) carry the agents' labels: the DaemonSet would
take those pods for its own.
*/}}
{{- define "gpu-agent.uninstallSelector" -}}
app.kubernetes.io/name: {{ include "gpu-agent.agentName" . }}-uninstall
app.kubernetes.io/component: uninstall
{{- end -}}

{{/*
The pod that runs `gpu-agent uninstall` on one node (uninstall-hook.yaml):
the hook (gpu-controller uninstall-agents) pins a copy to each node.
*/}}
{{- define "gpu-agent.uninstallPod" -}}
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "gpu-agent.agentName" . }}-uninstall-node
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "gpu-agent.labels" . | nindent 4 }}
    app.kubernetes.io/name: {{ include "gpu-agent.agentName" . }}-uninstall
    app.kubernetes.io/component: node-uninstall
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  priorityClassName: {{ .Values.daemonsets.priorityClassName }}
  # Whatever taints the node has now (a cordon, a NoExecute): its agent ran
  # there, and this undoes what it did.
  tolerations:
    - operator: Exists
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: uninstall
      image: {{ include "gpu-agent.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["/usr/bin/gpu-agent", "uninstall"]
      env:
        - name: GPU_AGENT_HOST_ROOT
          value: /host
      resources:
        requests:
          cpu: 10m
          memory: 32Mi
      securityContext:
        # Host files put back with their owners and modes, on hosts whose
        # SELinux or AppArmor confine containers too.
        privileged: true
      volumeMounts:
        - name: host-root
          mountPath: /host
        - name: kubelet-device-plugins
          mountPath: /host/var/lib/kubelet/device-plugins
        - name: kubelet-pod-resources
          mountPath: /host/var/lib/kubelet/pod-resources
  volumes:
    - name: host-root
      hostPath:
        path: {{ .Values.hostPaths.rootFS }}
        type: Directory
    - name: kubelet-device-plugins
      hostPath:
        path: {{ include "gpu-agent.kubeletRootDir" . }}/device-plugins
        type: Directory
    - name: kubelet-pod-resources
      hostPath:
        path: {{ include "gpu-agent.kubeletRootDir" . }}/pod-resources
        type: Directory
{{- end -}}
