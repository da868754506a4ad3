-- What an agent records when it sends a mail and the connection drops
-- before the answer: planned -> submitted -> outcome_unknown. Run as a login
-- in reconciler_agent (compose_agent). The agent in a real deployment does
-- this through the ledger client (ledger.Caller.Do) or these same SQL
-- functions; this file stands in for it so the compose daemon has one
-- receipt to settle. Idempotent: plan returns the existing receipt for the
-- key, and each move is made only from the state before it.
SELECT id, state FROM reconciler.plan(
    idempotency_key => 'compose-demo:welcome-mail',
    operation       => 'mail.send',
    dependency      => 'mailer',
    method          => 'POST',
    target          => '/v1/messages',
    -- reconciler fingerprint --method POST --target /v1/messages <<< '{"to":"ops@example.com","template":"welcome"}'
    fingerprint     => 'sha256:889849a4ea59a588bf01cfb7a3c337816887fa4327c33bbafaea3e79c530e5a7',
    intent          => '{"to":"ops@example.com","template":"welcome"}',
    actor           => 'agent:compose-demo');

SELECT id, (reconciler.transition(receipt_id => id, to_state => 'submitted',
    actor => 'agent:compose-demo', expected_state => 'planned')).state
FROM reconciler.receipts
WHERE idempotency_key = 'compose-demo:welcome-mail' AND state = 'planned';

SELECT id, (reconciler.transition(receipt_id => id, to_state => 'outcome_unknown',
    actor => 'agent:compose-demo', expected_state => 'submitted',
    detail => '{"error":{"code":"timeout","message":"connection reset after the request was written"}}')).state
FROM reconciler.receipts
WHERE idempotency_key = 'compose-demo:welcome-mail' AND state = 'submitted';
