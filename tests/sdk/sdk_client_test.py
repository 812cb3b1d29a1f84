"""Drive a running Baton with the official A2A Python SDK client (a2a-sdk 1.3.0).

Checks, over JSON-RPC, that the SDK accepts everything Baton sends:
  card           resolve {base}/.well-known/agent-card.json (JSONRPC 1.0 interface, streaming)
  send-message   blocking SendMessage to the default `echo` agent -> Task COMPLETED + echo artifact
  stream-message SendStreamingMessage -> task/status/artifact events ending in COMPLETED
  get-task       GetTask of the first task
  list-tasks     ListTasks (filtered by its contextId) contains the first task
  scenario-card  resolve {base}/agents/scenario/.well-known/agent-card.json
  cancel-task    messageId "tck-input-required-*" -> INPUT_REQUIRED, CancelTask -> CANCELED
  push-*         create / get / list / delete a TaskPushNotificationConfig whose url is a
                 local receiver started by this script (http://127.0.0.1:PORT/hook)
  push-delivery  (only with --push-delivery) a follow-up message on an input-required task
                 makes Baton POST a StreamResponse to the receiver

The SDK itself parses responses leniently (unknown fields ignored). By default this script
makes its parsing strict (protobuf ParseDict without ignore_unknown_fields, for the card and
every JSON-RPC result) so that unknown fields or unknown enum names fail the test; pass
--lenient to run the SDK exactly as shipped.

Run:
  python3 -m venv /tmp/sdk-venv && /tmp/sdk-venv/bin/pip install a2a-sdk==1.3.0
  /tmp/sdk-venv/bin/python tests/sdk/sdk_client_test.py http://localhost:8080 [--push-delivery]

Prints "ok <step>" per step; exits 1 with "FAIL <step>: <reason>" on the first failure.
Every step is bounded by --timeout seconds (default 20).
"""

import argparse
import asyncio
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from google.protobuf import json_format

import a2a.client.card_resolver as sdk_card_resolver
import a2a.client.transports.jsonrpc as sdk_jsonrpc
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH

SCENARIO_CARD_PATH = '/agents/scenario/.well-known/agent-card.json'
TERMINAL = {
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_REJECTED,
}


class Failure(Exception):
    """A check failed."""


def check(cond, msg):
    if not cond:
        raise Failure(msg)


def state(s):
    return TaskState.Name(s)


def make_strict():
    """Make the SDK reject unknown fields and unknown enum names."""

    def parse_strict(data, message):
        if isinstance(data, str | bytes):
            return json_format.Parse(data, message)
        return json_format.ParseDict(data, message)

    def parse_dict_strict(data, message, ignore_unknown_fields=False, **kw):
        return json_format.ParseDict(data, message, **kw)

    sdk_jsonrpc.parse_lenient = parse_strict
    sdk_card_resolver.ParseDict = parse_dict_strict


def user_message(text, message_id=None, task=None):
    msg = Message(
        message_id=message_id or f'sdk-{uuid.uuid4()}',
        role=Role.ROLE_USER,
        parts=[Part(text=text)],
    )
    if task is not None:
        msg.task_id, msg.context_id = task.id, task.context_id
    return msg


def texts(artifacts):
    return [p.text for a in artifacts for p in a.parts if p.WhichOneof('content') == 'text']


async def send_blocking(client, msg):
    """SendMessage (blocking); the result must be a Task."""
    events = [e async for e in client.send_message(SendMessageRequest(message=msg))]
    check(len(events) == 1, f'expected one response, got {len(events)}')
    check(events[0].HasField('task'), f'expected a Task, got {events[0]}')
    return events[0].task


class Receiver:
    """Tiny webhook receiver on 127.0.0.1 that records every POST."""

    def __init__(self):
        self.posts = []  # (headers, body bytes)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
                receiver.posts.append((dict(self.headers), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.url = f'http://127.0.0.1:{self.server.server_address[1]}/hook'
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


async def run(base, timeout, push_delivery, lenient):
    steps = []

    async def step(name, coro):
        try:
            result = await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            raise Failure(f'{name}: timed out after {timeout:g}s') from None
        except Failure as e:
            raise Failure(f'{name}: {e}') from None
        except Exception as e:  # SDK / parse / network errors
            raise Failure(f'{name}: {type(e).__name__}: {e}') from e
        print(f'ok {name}', flush=True)
        steps.append(name)
        return result

    async def resolve(path=AGENT_CARD_WELL_KNOWN_PATH):
        card = await A2ACardResolver(http, base, path).get_agent_card()
        # The interface ClientFactory.create() will pick (private helper, pinned SDK).
        iface = ClientFactory._find_best_interface(list(card.supported_interfaces), ['JSONRPC'])
        check(iface is not None, 'card has no supportedInterfaces entry with JSONRPC binding')
        check(iface.protocol_version in ('1.0', '1.0.0'),
              f'JSONRPC interface protocolVersion is {iface.protocol_version!r}, want "1.0"')
        return card

    receiver = Receiver()
    http = httpx.AsyncClient(timeout=timeout)
    # The factory adds "A2A-Version: 1.0" to the shared httpx client's headers.
    blocking = ClientFactory(ClientConfig(streaming=False, httpx_client=http))
    streaming = ClientFactory(ClientConfig(streaming=True, httpx_client=http))
    try:
        async def main_card():
            card = await resolve()
            # Without it the SDK silently falls back to blocking SendMessage.
            check(card.capabilities.streaming, 'card.capabilities.streaming is not true')
            return card

        card = await step('card', main_card())
        echo = blocking.create(card)
        echo_stream = streaming.create(card)

        async def send_message():
            task = await send_blocking(echo, user_message('hello from the python sdk'))
            check(task.id and task.context_id, 'task has no id or contextId')
            check(task.status.state == TaskState.TASK_STATE_COMPLETED,
                  f'state is {state(task.status.state)}, want TASK_STATE_COMPLETED')
            check(any('hello from the python sdk' in t for t in texts(task.artifacts)),
                  f'no artifact echoes the input text: {texts(task.artifacts)}')
            return task

        task1 = await step('send-message', send_message())

        async def stream_message():
            kinds, task_ids, last, echoed = [], set(), None, False
            async for ev in echo_stream.send_message(
                    SendMessageRequest(message=user_message('streamed hello'))):
                kind = ev.WhichOneof('payload')
                check(kind != 'message', f'expected task events, got a Message: {ev}')
                kinds.append(kind)
                body = getattr(ev, kind)
                task_ids.add(body.id if kind == 'task' else body.task_id)
                if kind in ('task', 'status_update'):
                    last = body.status.state
                arts = body.artifacts if kind == 'task' else (
                    [body.artifact] if kind == 'artifact_update' else [])
                echoed |= any('streamed hello' in t for t in texts(arts))
            check(kinds, 'stream ended without events')
            check(len(task_ids) == 1 and '' not in task_ids, f'bad task ids in events: {task_ids}')
            check(last == TaskState.TASK_STATE_COMPLETED,
                  f'last state {state(last or 0)}, want TASK_STATE_COMPLETED (events: {kinds})')
            check(echoed, f'no event carried the echoed text (events: {kinds})')

        await step('stream-message', stream_message())

        async def get_task():
            got = await echo.get_task(GetTaskRequest(id=task1.id))
            check(got.id == task1.id, f'GetTask returned task {got.id!r}')
            check(got.status.state == TaskState.TASK_STATE_COMPLETED,
                  f'state is {state(got.status.state)}')
            check(texts(got.artifacts) == texts(task1.artifacts),
                  'artifacts differ from the SendMessage result')

        await step('get-task', get_task())

        async def list_tasks():
            resp = await echo.list_tasks(ListTasksRequest(context_id=task1.context_id))
            ids = [t.id for t in resp.tasks]
            check(task1.id in ids, f'task {task1.id} not in ListTasks result {ids}')
            check(all(t.context_id == task1.context_id for t in resp.tasks),
                  'contextId filter not applied')

        await step('list-tasks', list_tasks())

        scenario_card = await step('scenario-card', resolve(SCENARIO_CARD_PATH))
        scenario = blocking.create(scenario_card)

        async def input_required():
            task = await send_blocking(scenario, user_message(
                'please ask me something', f'tck-input-required-{uuid.uuid4()}'))
            check(task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED,
                  f'state is {state(task.status.state)}, want TASK_STATE_INPUT_REQUIRED')
            return task

        async def cancel_task():
            task = await input_required()
            canceled = await scenario.cancel_task(CancelTaskRequest(id=task.id))
            check(canceled.id == task.id, f'CancelTask returned task {canceled.id!r}')
            check(canceled.status.state == TaskState.TASK_STATE_CANCELED,
                  f'state after cancel is {state(canceled.status.state)}')
            got = await scenario.get_task(GetTaskRequest(id=task.id))
            check(got.status.state == TaskState.TASK_STATE_CANCELED,
                  f'GetTask after cancel: {state(got.status.state)}')

        await step('cancel-task', cancel_task())

        # Push notification config CRUD on a fresh input-required task.
        check(scenario_card.capabilities.push_notifications,
              'push: scenario card capabilities.pushNotifications is not true')
        task2 = await step('push-task', input_required())
        token = f'tok-{uuid.uuid4()}'

        async def push_create():
            created = await scenario.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task2.id, id=f'cfg-{uuid.uuid4()}',
                                           url=receiver.url, token=token))
            check(created.id, 'created config has no id')
            check(created.task_id == task2.id, f'created config taskId {created.task_id!r}')
            check(created.url == receiver.url, f'created config url {created.url!r}')
            return created.id

        cfg_id = await step('push-create', push_create())

        async def push_get():
            got = await scenario.get_task_push_notification_config(
                GetTaskPushNotificationConfigRequest(task_id=task2.id, id=cfg_id))
            check(got.id == cfg_id and got.url == receiver.url, f'got {got}')

        async def push_list(present=True):
            resp = await scenario.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task2.id))
            ids = [c.id for c in resp.configs]
            check((cfg_id in ids) == present,
                  f'config {cfg_id} {"missing from" if present else "still in"} list {ids}')

        await step('push-get', push_get())
        await step('push-list', push_list())

        if push_delivery:
            async def delivery():
                answer = user_message('here is my answer', task=task2)
                followed = await send_blocking(scenario, answer)
                check(followed.id == task2.id, f'follow-up went to task {followed.id!r}')
                while True:  # bounded by the step timeout
                    for headers, body in list(receiver.posts):
                        event = StreamResponse()
                        json_format.Parse(body, event, ignore_unknown_fields=lenient)
                        if task2.id in body.decode():
                            got = {k.lower(): v for k, v in headers.items()}
                            check(got.get('x-a2a-notification-token') == token,
                                  'X-A2A-Notification-Token missing or wrong')
                            return
                    await asyncio.sleep(0.2)

            await step('push-delivery', delivery())

        async def push_delete():
            await scenario.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=task2.id, id=cfg_id))
            await push_list(present=False)

        await step('push-delete', push_delete())

        async def cleanup():  # leave no input-required task behind
            got = await scenario.get_task(GetTaskRequest(id=task2.id))
            if got.status.state not in TERMINAL:
                await scenario.cancel_task(CancelTaskRequest(id=task2.id))

        await step('cleanup', cleanup())
    finally:
        await http.aclose()
        receiver.close()
    print(f'all {len(steps)} steps passed', flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('base', help='Baton base URL, e.g. http://localhost:8080')
    ap.add_argument('--timeout', type=float, default=20.0, help='seconds per step')
    ap.add_argument('--push-delivery', action='store_true',
                    help='also check that Baton POSTs a push notification to the receiver')
    ap.add_argument('--lenient', action='store_true',
                    help="use the SDK's own lenient parsing (ignore unknown fields)")
    args = ap.parse_args()
    if not args.lenient:
        make_strict()
    try:
        asyncio.run(run(args.base.rstrip('/'), args.timeout, args.push_delivery, args.lenient))
    except Failure as e:
        print(f'FAIL {e}', file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == '__main__':
    main()
