{{/*
Helpers shared by the templates. Object names are fixed (gpushard-webhook, gpushard-agent, ...), as in
deploy/: the webhook configuration, the admission policies and the docs name them, and
tests/chart/test_drift.py compares each object with its deploy/ twin.
*/}}

{{/*
An object's labels: those deploy/ gives it (app.kubernetes.io/name and component where it has them, and
app.kubernetes.io/part-of, which deploy/base's kustomization adds to every object), the release's own,
then commonLabels. Called with a dict: ctx (the root), component (optional), named (true: the name label
without a component), extra (optional labels).
*/}}
{{- define "gpushard.labels" -}}
{{- $ctx := .ctx -}}
{{- $labels := dict "app.kubernetes.io/part-of" "gpushard" -}}
{{- if or .named .component }}{{ $_ := set $labels "app.kubernetes.io/name" "gpushard" }}{{ end -}}
{{- with .component }}{{ $_ := set $labels "app.kubernetes.io/component" . }}{{ end -}}
{{- $labels = merge $labels (.extra | default dict) -}}
{{- $_ := set $labels "app.kubernetes.io/managed-by" $ctx.Release.Service -}}
{{- $_ := set $labels "app.kubernetes.io/instance" $ctx.Release.Name -}}
{{- $_ := set $labels "app.kubernetes.io/version" ($ctx.Chart.AppVersion | toString) -}}
{{- $_ := set $labels "helm.sh/chart" (printf "%s-%s" $ctx.Chart.Name $ctx.Chart.Version | replace "+" "_") -}}
{{- toYaml (merge $labels $ctx.Values.commonLabels) -}}
{{- end -}}

{{/*
An object's annotations block ("annotations:" and its entries), or nothing: the object's own (extra),
then commonAnnotations. Called with a dict: ctx, extra (optional).
*/}}
{{- define "gpushard.annotations" -}}
{{- $annotations := merge dict (.extra | default dict) .ctx.Values.commonAnnotations -}}
{{- with $annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
The labels of the pods a workload makes: the selector's (name and component, never changed by values:
a Deployment's selector cannot change) and podLabels. Called with a dict: ctx, component.
*/}}
{{- define "gpushard.podLabels" -}}
{{- $labels := dict "app.kubernetes.io/name" "gpushard" "app.kubernetes.io/component" .component -}}
{{- toYaml (merge $labels .ctx.Values.podLabels) -}}
{{- end -}}

{{/*
The pod template's metadata: its labels and, when podAnnotations is set, its annotations.
Called with a dict: ctx, component.
*/}}
{{- define "gpushard.podMetadata" -}}
labels:
  {{- include "gpushard.podLabels" . | nindent 2 }}
{{- with .ctx.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The selector of a component's pods, as deploy/ has it. */}}
{{- define "gpushard.selector" -}}
app.kubernetes.io/name: gpushard
app.kubernetes.io/component: {{ . }}
{{- end -}}

{{/* The one image of every container: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "gpushard.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* imagePullSecrets of a pod spec, or nothing. Called with a dict: ctx, indent (of the pod spec's keys). */}}
{{- define "gpushard.pullSecrets" -}}
{{- with .ctx.Values.image.pullSecrets -}}
{{- $secrets := list -}}
{{- range . }}{{ $secrets = append $secrets (dict "name" .) }}{{ end -}}
{{- dict "imagePullSecrets" $secrets | toYaml | nindent $.indent -}}
{{- end -}}
{{- end -}}

{{/* The Secret that holds the webhook's serving certificate (tls.crt, tls.key and, but for certs.mode secret, ca.crt). */}}
{{- define "gpushard.tlsSecret" -}}
{{- if eq .Values.certs.mode "secret" -}}
{{ required "certs.secret.name: the Secret with tls.crt and tls.key, needed with certs.mode secret" .Values.certs.secret.name }}
{{- else -}}
gpushard-tls
{{- end -}}
{{- end -}}

{{/* Whether the enforce side is installed (the enforce webhook, the agent, the re-placement loop). */}}
{{- define "gpushard.enforcing" -}}
{{- if eq .Values.mode "enforce" }}true{{ end -}}
{{- end -}}

{{/* A webhook's caBundle with certs.mode secret, or nothing (the Job or cert-manager fills it in). */}}
{{- define "gpushard.caBundle" -}}
{{- if eq .Values.certs.mode "secret" -}}
caBundle: {{ required "certs.secret.caBundle: the base64 PEM of the CA that signed the Secret's certificate, needed with certs.mode secret" .Values.certs.secret.caBundle }}
{{- end -}}
{{- end -}}

{{/*
One list of devicePolicy as the admission policies read it: its names joined by single spaces, written
into a CEL raw string r'''...''' of gpushard-device-channels or gpushard-device-claims. A name may hold only
a-z, 0-9, "-", "." and "/" (a ServiceAccount is namespace/name): anything else (a space, a quote, a new
line) fails the release here, naming the value, as values.schema.json does (which `helm install
--skip-schema-validation` skips). Called with a dict: ctx, key (the list's key under devicePolicy).
*/}}
{{- define "gpushard.policyList" -}}
{{- $names := index .ctx.Values.devicePolicy .key | default list -}}
{{- range $names -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9./]*[a-z0-9])?$" (toString .)) -}}
{{- fail (printf "gpushard: devicePolicy.%s holds %q, which is no name; list one namespace, ServiceAccount (namespace/name) or device class per entry, of a-z, 0-9, \"-\", \".\" and \"/\" only" $.key (toString .)) -}}
{{- end -}}
{{- end -}}
{{- join " " $names -}}
{{- end -}}

{{/* What both webhooks are called for: Pods and every kind with a pod template. */}}
{{- define "gpushard.webhookRules" -}}
# Pods are rewritten once, when created: their resources cannot change afterwards.
- apiGroups: [""]
  apiVersions: [v1]
  operations: [CREATE]
  resources: [pods]
  scope: Namespaced
# Debug containers (`kubectl debug`) join a running pod through this subresource; they
# hold no share, so gpushard hides the node's cards from them (their image may say "all").
- apiGroups: [""]
  apiVersions: [v1]
  operations: [UPDATE]
  resources: [pods/ephemeralcontainers]
  scope: Namespaced
# Pod templates on CREATE and UPDATE: a fractional request in a template is refused by
# the API server unless it is rewritten to integer shares first.
- apiGroups: [""]
  apiVersions: [v1]
  operations: [CREATE, UPDATE]
  resources: [replicationcontrollers, podtemplates]
  scope: Namespaced
- apiGroups: [apps]
  apiVersions: [v1]
  operations: [CREATE, UPDATE]
  resources: [deployments, statefulsets, daemonsets, replicasets]
  scope: Namespaced
- apiGroups: [batch]
  apiVersions: [v1]
  operations: [CREATE, UPDATE]
  resources: [jobs, cronjobs]
  scope: Namespaced
{{- end -}}
