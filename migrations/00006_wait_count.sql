-- Issue 9, item 3 ("waiting is not checking"): a row handed back without a
-- read that counts (deferred by its dependency's protection, held back for
-- a positive control, released because its lease was too short or the
-- reconciler was stopping) is a wait, not a check: it does not use up
-- max_checks. wait_count counts those waits since the receipt (last) became
-- outcome_unknown, so the evidence of a bound_reached settlement can say how
-- many reads and how many waits there were. The claim that moves a receipt
-- from outcome_unknown to reconciling resets it, as the trigger resets
-- check_count on a requeue.

-- +goose Up
ALTER TABLE reconciler.receipts ADD COLUMN wait_count integer NOT NULL DEFAULT 0;
-- Where the roles of docs/roles.sql are already in use, the daemon's role
-- may write the new column as it writes check_count (docs/roles.sql grants
-- it too, for databases set up after this migration).
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_worker') IS NOT NULL THEN
        GRANT UPDATE (wait_count) ON reconciler.receipts TO reconciler_worker;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
ALTER TABLE reconciler.receipts DROP COLUMN wait_count;
