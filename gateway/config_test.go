package gateway_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/receiptledger/reconciler/gateway"
)

func TestConfigErrorsNameTheField(t *testing.T) {
	good := routesFile("http://127.0.0.1:1", "")
	if _, err := gateway.ParseConfig("routes.yaml", []byte(good), testEnv); err != nil {
		t.Fatal(err)
	}
	cases := []struct{ name, from, to, want string }{
		{"unknown field", "    dependency: blog-api", "    dependency: blog-api\n    depedency: x", "depedency"},
		{"token not set", "{env: TOKEN_B}", "{env: NO_SUCH_VAR}", "agents[1].token: environment variable NO_SUCH_VAR is not set"},
		{"upstream credential not set", "auth: {env: BLOG_KEY}", "auth: {env: NOPE}", "routes[0].auth: environment variable NOPE"},
		{"credential in the URL", "upstream: http://", "upstream: http://user:pw@", "routes[0].upstream: must hold no credentials"},
		{"not http", "upstream: http://127.0.0.1:1", "upstream: file:///etc", "routes[0].upstream"},
		{"reserved prefix", "prefix: /blog", "prefix: /receipts", "routes[0].prefix: /receipts is the gateway's own endpoint"},
		{"trailing slash", "prefix: /blog", "prefix: /blog/", "routes[0].prefix"},
		{"dot segment", "prefix: /blog", "prefix: /a/../b", "routes[0].prefix"},
		{"no dependency", "    dependency: blog-api\n", "", "routes[0].dependency"},
		{"bad duration", "timeout: 2s", "timeout: soon", "routes[0].timeout"},
		{"webhook not http", "timeout: 2s", "timeout: 2s\n    webhook: {url: 'ftp://h/x', secret: {env: HOOK_SECRET}}", "routes[0].webhook.url: want an http or https URL"},
		{"webhook credential in the URL", "timeout: 2s", "timeout: 2s\n    webhook: {url: 'https://u:" + hookSecret + "@h/x', secret: {env: HOOK_SECRET}}", "routes[0].webhook.url: must hold no credentials"},
		{"webhook secret short", "timeout: 2s", "timeout: 2s\n    webhook: {url: 'https://h/x', secret: {env: TOKEN_A}}", "routes[0].webhook.secret: a webhook secret must be at least 32 bytes"},
		{"webhook secret not set", "timeout: 2s", "timeout: 2s\n    webhook: {url: 'https://h/x', secret: {env: NOPE}}", "routes[0].webhook.secret: environment variable NOPE"},
		{"webhook bad attempts", "timeout: 2s", "timeout: 2s\n    webhook: {url: 'https://h/x', secret: {env: HOOK_SECRET}, max_attempts: -1}", "routes[0].webhook.max_attempts"},
		{"credential header kept", "replay: {retention: 1h}", "replay: {headers: [Set-Cookie]}", "replay.headers[0]"},
		{"credential header named so", "replay: {retention: 1h}", "replay: {headers: [Content-Type, X-Upstream-Credential]}", "replay.headers[1]"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(good, tc.from) {
				t.Fatalf("the base file lacks %q", tc.from)
			}
			_, err := gateway.ParseConfig("routes.yaml", []byte(strings.Replace(good, tc.from, tc.to, 1)), testEnv)
			var ce *gateway.ConfigError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "routes.yaml") {
				t.Fatalf("error %v, want a *ConfigError naming %q", err, tc.want)
			}
			if strings.Contains(err.Error(), tokenA) || strings.Contains(err.Error(), upstreamKey) || strings.Contains(err.Error(), hookSecret) {
				t.Fatal("the error prints a credential")
			}
		})
	}
}
